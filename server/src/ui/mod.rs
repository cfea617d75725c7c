//! The web dashboard at `/ui` (`docs/api.md`, "The dashboard").
//!
//! - Pages: one HTML page, one ES module and one stylesheet (`server/ui/`), embedded in the
//!   binary with `include_str!`; no framework, nothing fetched from elsewhere.
//! - Sign-in: the page's form posts the server's bearer token to `POST /ui/login`, which
//!   answers with a session cookie ([`session`]); the token stays on the server.
//! - Data and actions: `/ui/api/...`, behind [`require_session`] (401 without a live session,
//!   403 for a state-changing request without the session's CSRF token). Each handler is one
//!   or a few calls of the call surface (`ember_runtime::call`), exactly what the native
//!   routes send, so the dashboard works the same over `ember serve` and `ember gateway`.
//!
//! The server's bearer-token check leaves `/ui` alone ([`is_ui_path`]); the API routes still
//! want the bearer token, never the cookie.

pub mod resources;
pub mod session;
pub mod terminal;

use std::time::Instant;

use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Form, Json, Router};
use ember_runtime::call::{self, EventKind, ExecRequest, Io, RunCodeRequest};
use ember_runtime::template::BuildEvent;
use ember_runtime::{
    AuditFilter, ForkRequest, ListFilter, LogKind, SandboxInfo, SnapshotRequest,
    State as SandboxState,
};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::error::{ApiError, ApiJson};
use super::{stream, AppState};
use session::{SessionError, CSRF_HEADER};

const INDEX_HTML: &str = include_str!("../../ui/index.html");
const APP_JS: &str = include_str!("../../ui/app.js");
const APP_CSS: &str = include_str!("../../ui/app.css");
// xterm.js and its fit addon, from npm at build time (server/build.rs, server/ui/npm).
const XTERM_JS: &str = include_str!(concat!(env!("OUT_DIR"), "/vendor/xterm.js"));
const XTERM_CSS: &str = include_str!(concat!(env!("OUT_DIR"), "/vendor/xterm.css"));
const ADDON_FIT_JS: &str = include_str!(concat!(env!("OUT_DIR"), "/vendor/addon-fit.js"));

/// Rows per page of the sandbox list (at most).
pub const PAGE_MAX: usize = 50;
/// Output kept from one cell or command, bytes (more is dropped and said so).
pub const OUTPUT_CAP: usize = 4 << 20;
/// Bytes of a log's tail the sandbox page shows.
pub const LOG_TAIL_BYTES: u64 = 64 << 10;
/// The template whose sandboxes have a browser and its live view (`server/src/browser.rs`).
pub const BROWSER_TEMPLATE: &str = "browser";
/// Time limit of one cell or command from the dashboard.
pub const CALL_TIMEOUT_MS: u64 = 120_000;

/// The page's Content-Security-Policy: only this server's script and style (and style
/// elements carrying this response's nonce: xterm.js writes its theme into one); images also
/// from `data:` (rich results); no frames, no plugins, no form posts elsewhere.
fn csp(nonce: &str) -> String {
    format!(
        "default-src 'none'; script-src 'self'; style-src 'self' 'nonce-{nonce}'; \
         img-src 'self' data:; connect-src 'self'; form-action 'self'; \
         frame-ancestors 'none'; base-uri 'none'"
    )
}

/// Whether `path` belongs to the dashboard (its own auth; the bearer check leaves it alone).
pub fn is_ui_path(path: &str) -> bool {
    path == "/ui" || path.starts_with("/ui/")
}

/// The dashboard's routes, added to the server's router.
pub fn routes(router: Router<AppState>, st: AppState) -> Router<AppState> {
    let api = Router::new()
        .route("/ui/api/session", get(session_info))
        .route("/ui/logout", post(logout))
        .route("/ui/api/overview", get(overview))
        .route("/ui/api/templates", get(templates))
        .route("/ui/api/templates/{name}/build", post(build_template))
        .route("/ui/api/sandboxes", get(sandboxes))
        .route("/ui/api/sandboxes/{id}", get(sandbox))
        .route("/ui/api/sandboxes/{id}/usage", get(usage))
        .route("/ui/api/sandboxes/{id}/log", get(log_tail))
        .route("/ui/api/sandboxes/{id}/pause", post(pause))
        .route("/ui/api/sandboxes/{id}/resume", post(resume))
        .route("/ui/api/sandboxes/{id}/kill", post(kill))
        .route("/ui/api/sandboxes/{id}/fork", post(fork))
        .route("/ui/api/sandboxes/{id}/snapshot", post(snapshot))
        .route("/ui/api/sandboxes/{id}/code", post(run_code))
        .route("/ui/api/sandboxes/{id}/exec", post(exec))
        .route("/ui/api/sandboxes/{id}/artifacts/collect", post(collect))
        .route("/ui/api/sandboxes/{id}/artifact", get(artifact))
        .route("/ui/api/sandboxes/{id}/terminal", get(terminal::terminal))
        .route_layer(middleware::from_fn_with_state(st, require_session));
    router
        .route("/ui", get(|| async { redirect("/ui/") }))
        .route("/ui/", get(index))
        .route(
            "/ui/app.js",
            get(|| async { asset(APP_JS, "text/javascript") }),
        )
        .route("/ui/app.css", get(|| async { asset(APP_CSS, "text/css") }))
        .route(
            "/ui/vendor/xterm.js",
            get(|| async { asset(XTERM_JS, "text/javascript") }),
        )
        .route(
            "/ui/vendor/addon-fit.js",
            get(|| async { asset(ADDON_FIT_JS, "text/javascript") }),
        )
        .route(
            "/ui/vendor/xterm.css",
            get(|| async { asset(XTERM_CSS, "text/css") }),
        )
        .route("/ui/login", post(login))
        .merge(api)
}

fn no_store(resp: &mut Response) {
    let h = resp.headers_mut();
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        "x-content-type-options",
        HeaderValue::from_static("nosniff"),
    );
}

fn asset(body: &'static str, content_type: &'static str) -> Response {
    let mut resp = body.into_response();
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    no_store(&mut resp);
    resp
}

fn redirect(to: &'static str) -> Response {
    let mut resp = StatusCode::SEE_OTHER.into_response();
    resp.headers_mut()
        .insert(header::LOCATION, HeaderValue::from_static(to));
    resp
}

async fn index() -> Response {
    let nonce = match session::random_hex() {
        Ok(n) => n,
        Err(e) => return ApiError::internal(format!("a style nonce: {e}")).into_response(),
    };
    let html = INDEX_HTML.replace("{{STYLE_NONCE}}", &nonce);
    let mut resp = html.into_response();
    no_store(&mut resp);
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    match HeaderValue::from_str(&csp(&nonce)) {
        Ok(v) => h.insert(header::CONTENT_SECURITY_POLICY, v),
        Err(e) => return ApiError::internal(format!("the CSP header: {e}")).into_response(),
    };
    h.insert("x-frame-options", HeaderValue::from_static("DENY"));
    h.insert("referrer-policy", HeaderValue::from_static("no-referrer"));
    resp
}

impl IntoResponse for SessionError {
    fn into_response(self) -> Response {
        let (status, code) = match self {
            SessionError::NoSession | SessionError::WrongToken => {
                (StatusCode::UNAUTHORIZED, "unauthorized")
            }
            SessionError::Csrf => (StatusCode::FORBIDDEN, "csrf"),
            SessionError::Random(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        };
        ApiError::new(status, code, self.to_string()).into_response()
    }
}

/// The session a request came with (put there by [`require_session`]).
#[derive(Debug, Clone)]
struct SessionId(String);

/// A live session for every `/ui/api` request and sign-out; its CSRF token in
/// [`CSRF_HEADER`] for every method but GET and HEAD.
async fn require_session(State(st): State<AppState>, mut req: Request, next: Next) -> Response {
    let id = req
        .headers()
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find_map(session::cookie_value)
        .map(str::to_string);
    let Some(id) = id else {
        return SessionError::NoSession.into_response();
    };
    let csrf = match st.inner.ui.check(&id, Instant::now()) {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let given = req.headers().get(CSRF_HEADER).and_then(|v| v.to_str().ok());
        if let Err(e) = session::csrf_ok(given, &csrf) {
            return e.into_response();
        }
    }
    req.extensions_mut().insert(SessionId(id));
    let mut resp = next.run(req).await;
    no_store(&mut resp);
    resp
}

/// The sign-in form.
#[derive(Debug, Deserialize)]
struct LoginForm {
    token: String,
}

/// `POST /ui/login` (a form): the server's token → a session cookie and back to the page;
/// a wrong token → back to the page with `?signin=failed` (no cookie).
async fn login(State(st): State<AppState>, Form(form): Form<LoginForm>) -> Response {
    match st
        .inner
        .ui
        .sign_in(&form.token, &st.inner.token, Instant::now())
    {
        Ok(s) => {
            let mut resp = redirect("/ui/");
            match HeaderValue::from_str(&session::set_cookie(&s.id)) {
                Ok(v) => {
                    resp.headers_mut().insert(header::SET_COOKIE, v);
                    resp
                }
                Err(e) => ApiError::internal(format!("session cookie: {e}")).into_response(),
            }
        }
        Err(SessionError::WrongToken) => {
            tracing::warn!("dashboard sign-in with a wrong token");
            redirect("/ui/?signin=failed")
        }
        Err(e) => e.into_response(),
    }
}

/// `POST /ui/logout`: ends the session and removes the cookie.
async fn logout(State(st): State<AppState>, req: Request) -> Response {
    if let Some(SessionId(id)) = req.extensions().get::<SessionId>() {
        st.inner.ui.sign_out(id);
    }
    let mut resp = Json(json!({"ok": true})).into_response();
    if let Ok(v) = HeaderValue::from_str(&session::clear_cookie()) {
        resp.headers_mut().insert(header::SET_COOKIE, v);
    }
    resp
}

/// `GET /ui/api/session`: the CSRF token the page sends with its actions.
async fn session_info(State(st): State<AppState>, req: Request) -> Result<Json<Value>, ApiError> {
    let Some(SessionId(id)) = req.extensions().get::<SessionId>() else {
        return Err(ApiError::internal("no session on a session route"));
    };
    let csrf = st
        .inner
        .ui
        .check(id, Instant::now())
        .map_err(|e| ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", e.to_string()))?;
    Ok(Json(json!({ "csrf": csrf })))
}

/// What the server may hold at once (None where the backend does not say: a gateway).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Capacity {
    /// Most sandboxes with a VMM.
    pub max_running: Option<u64>,
    /// Most guest memory committed, MiB.
    pub max_memory_mib: Option<u64>,
}

/// `GET /ui/api/overview`: sandboxes by state, committed memory, the caps, creates.
async fn overview(State(st): State<AppState>) -> Result<Json<Value>, ApiError> {
    let m = st.call(|b| b.call(call::GetMetrics {}, Io::none())).await?;
    let cap = st.backend().capacity();
    let live: u64 = ["creating", "running", "pausing", "resuming"]
        .iter()
        .map(|s| m.by_state.get(*s).copied().unwrap_or(0))
        .sum();
    Ok(Json(json!({
        "by_state": m.by_state,
        "with_vmm": live,
        "committed_memory_mib": m.committed_memory_mib,
        "max_running": cap.max_running,
        "max_memory_mib": cap.max_memory_mib,
        "creates": m.creates,
        "create_failures": m.create_failures,
        "vmm_failures": m.vmm_failures,
        "create_ms_sum": m.create_ms.sum,
        "create_ms_count": m.create_ms.count,
    })))
}

/// `GET /ui/api/templates`.
async fn templates(State(st): State<AppState>) -> Result<Json<Value>, ApiError> {
    let t = st
        .call(|b| b.call(call::ListTemplates {}, Io::none()))
        .await?;
    Ok(Json(json!(t)))
}

/// The list's query: `state` (a state, `live` (default) or `all`), `template`, `page` (from 0).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    #[serde(default)]
    state: Option<String>,
    #[serde(default)]
    template: Option<String>,
    /// `key=value` pairs, comma-separated: sandboxes whose metadata has all of them.
    #[serde(default)]
    metadata: Option<String>,
    #[serde(default)]
    page: Option<usize>,
}

/// `k=v,k2=v2` → the pairs (blank: none); a pair without `=` or with an empty key is refused.
fn metadata_filter(
    s: Option<&str>,
) -> Result<std::collections::BTreeMap<String, String>, ApiError> {
    let mut out = std::collections::BTreeMap::new();
    for pair in s.unwrap_or("").split(',').map(str::trim) {
        if pair.is_empty() {
            continue;
        }
        match pair.split_once('=') {
            Some((k, v)) if !k.trim().is_empty() => {
                out.insert(k.trim().to_string(), v.trim().to_string());
            }
            _ => {
                return Err(ApiError::invalid(format!(
                    "metadata={pair:?}: expected key=value pairs separated by commas"
                )))
            }
        }
    }
    Ok(out)
}

/// One page of the filtered list, and how many there are in all.
#[derive(Debug, Serialize)]
pub struct Page {
    /// Sandboxes that pass the filters.
    pub total: usize,
    /// This page (from 0).
    pub page: usize,
    /// Rows per page.
    pub per_page: usize,
    /// This page's sandboxes, newest first.
    pub items: Vec<SandboxInfo>,
    /// The templates of the listed sandboxes (for the filter's choices).
    pub templates: Vec<String>,
}

/// The list call's filter for `state` (None: not a known choice).
fn list_filter(state: Option<&str>) -> Option<ListFilter> {
    let mut f = ListFilter::default();
    match state.unwrap_or("live") {
        "" | "live" => {}
        "all" => f.all = true,
        s => f.state = Some(SandboxState::parse(s)?),
    }
    Some(f)
}

/// Cuts `all` (newest first) to page `page` of those from `template`.
pub fn paginate(all: Vec<SandboxInfo>, template: Option<&str>, page: usize) -> Page {
    let mut templates: Vec<String> = all.iter().filter_map(|s| s.template.clone()).collect();
    templates.sort();
    templates.dedup();
    let want = template.filter(|t| !t.is_empty());
    let matching: Vec<SandboxInfo> = all
        .into_iter()
        .filter(|s| want.is_none_or(|t| s.template.as_deref() == Some(t)))
        .collect();
    let total = matching.len();
    let last = total.saturating_sub(1) / PAGE_MAX;
    let page = page.min(last);
    let items = matching
        .into_iter()
        .skip(page * PAGE_MAX)
        .take(PAGE_MAX)
        .collect();
    Page {
        total,
        page,
        per_page: PAGE_MAX,
        items,
        templates,
    }
}

/// `GET /ui/api/sandboxes?state=&template=&metadata=&page=`: one page of at most [`PAGE_MAX`].
async fn sandboxes(
    State(st): State<AppState>,
    Query(q): Query<ListQuery>,
) -> Result<Json<Page>, ApiError> {
    let mut filter = list_filter(q.state.as_deref()).ok_or_else(|| {
        ApiError::invalid(format!(
            "state={:?}: expected live, all or one of {}",
            q.state.as_deref().unwrap_or(""),
            SandboxState::ALL.map(|s| s.as_str()).join(", ")
        ))
    })?;
    filter.metadata = metadata_filter(q.metadata.as_deref())?;
    let all = st
        .call(move |b| b.call(call::List { filter }, Io::none()))
        .await?;
    Ok(Json(paginate(
        all,
        q.template.as_deref(),
        q.page.unwrap_or(0),
    )))
}

/// `GET /ui/api/sandboxes/{id}`: the sandbox, its history, its last 200 audit records and
/// its artifacts.
async fn sandbox(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    // The browser's live view takes the sandbox's own token (never the server's) in its URL.
    let view_token = super::ports::access_token(&st, &id);
    st.call(move |b| {
        let info = b.call(call::Get { id: id.clone() }, Io::none())?;
        let view_url = (info.template.as_deref() == Some(BROWSER_TEMPLATE))
            .then(|| format!("/v1/sandboxes/{id}/view?token={view_token}"));
        let history = b.call(call::History { id: id.clone() }, Io::none())?;
        let audit = b.call(
            call::Audit {
                filter: AuditFilter {
                    sandbox: Some(id.clone()),
                    limit: Some(200),
                    ..Default::default()
                },
            },
            Io::none(),
        )?;
        let artifacts = b.call(call::Artifacts { id: id.clone() }, Io::none())?;
        Ok(json!({
            "sandbox": info,
            "history": history,
            "audit": audit,
            "artifacts": artifacts,
            "view_url": view_url,
        }))
    })
    .await
    .map(Json)
}

/// `POST /ui/api/templates/{name}/build` (body `{rebuild?}`): builds the template (a
/// `build_template` call; a cached one is found, not rebuilt) and streams its progress as
/// NDJSON lines, as `POST /v1/templates/{name}/build` does: `step`, `output`, `up_to_date`,
/// then `done` or `error`.
async fn build_template(
    State(st): State<AppState>,
    Path(name): Path<String>,
    ApiJson(body): ApiJson<BuildBody>,
) -> Response {
    let b = st.backend();
    stream::ndjson(
        move |emit| {
            let t = b.call(
                call::BuildTemplate {
                    name,
                    rebuild: body.rebuild,
                },
                Io::progress(&mut |ev| {
                    let v = match ev {
                        BuildEvent::Step(s) => json!({"type": "step", "message": s}),
                        BuildEvent::Output(s) => json!({"type": "output", "text": s}),
                        BuildEvent::UpToDate => json!({"type": "up_to_date"}),
                    };
                    // A build runs to its end (and is cached) even when the page went away.
                    let _ = emit(stream::line(&v));
                }),
            )?;
            Ok(json!({"type": "done", "template": t}))
        },
        None,
    )
    .await
}

/// A template build's options.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct BuildBody {
    #[serde(default)]
    rebuild: bool,
}

/// `GET /ui/api/sandboxes/{id}/usage`: the sandbox's resource samples kept here
/// ([`resources`]), after taking a new one when one is due. A sandbox that is not running
/// has no usage now: its samples so far and why (`idle`).
async fn usage(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let mut idle = None;
    if st.inner.ui_usage.claim(&id, Instant::now()) {
        let key = id.clone();
        match st
            .call(move |b| b.call(call::GetUsage { id: key }, Io::none()))
            .await
        {
            Ok(u) => st.inner.ui_usage.push(&id, u),
            Err(e) if e.status == StatusCode::CONFLICT => idle = Some(e.message),
            Err(e) => return Err(e),
        }
    }
    Ok(Json(json!({
        "samples": st.inner.ui_usage.samples(&id),
        "max_samples": resources::MAX_SAMPLES,
        "idle": idle,
    })))
}

/// `?kind=` of a log tail: `serial` (default) or `vmm`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LogQuery {
    #[serde(default)]
    kind: Option<LogKind>,
}

/// `GET /ui/api/sandboxes/{id}/log?kind=serial|vmm`: the last [`LOG_TAIL_BYTES`] of the
/// sandbox's serial console or VMM log (the guest's bytes as text: the page shows them as
/// text only).
async fn log_tail(
    State(st): State<AppState>,
    Path(id): Path<String>,
    Query(q): Query<LogQuery>,
) -> Result<Json<Value>, ApiError> {
    let log = q.kind.unwrap_or(LogKind::Serial);
    let t = st
        .call(move |b| {
            b.call(
                call::GetLogTail {
                    id,
                    log,
                    max_bytes: LOG_TAIL_BYTES,
                },
                Io::none(),
            )
        })
        .await?;
    Ok(Json(json!(t)))
}

async fn pause(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<SandboxInfo>, ApiError> {
    st.call(move |b| b.call(call::Pause { id }, Io::none()))
        .await
        .map(Json)
}

async fn resume(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<SandboxInfo>, ApiError> {
    st.call(move |b| b.call(call::Resume { id, reboot: false }, Io::none()))
        .await
        .map(Json)
}

async fn kill(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<SandboxInfo>, ApiError> {
    st.call(move |b| b.call(call::Kill { id }, Io::none()))
        .await
        .map(Json)
}

/// `POST /ui/api/sandboxes/{id}/fork`: one new sandbox from this one (a `fork` call of
/// count 1, the parent's timeout and metadata).
async fn fork(State(st): State<AppState>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let req = ForkRequest {
        count: 1,
        timeout_secs: None,
        metadata: None,
    };
    st.call(move |b| b.call(call::Fork { id, req }, Io::none()))
        .await
        .map(|v| Json(json!(v)))
}

/// `POST /ui/api/sandboxes/{id}/snapshot` (body `{name?}`): a named snapshot of it.
async fn snapshot(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<SnapshotRequest>,
) -> Result<Json<Value>, ApiError> {
    st.call(move |b| b.call(call::TakeSnapshot { id, req }, Io::none()))
        .await
        .map(|v| Json(json!(v)))
}

async fn collect(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    st.call(move |b| b.call(call::CollectArtifacts { id }, Io::none()))
        .await
        .map(|v| Json(json!(v)))
}

/// Output of one cell or command, as the page shows it.
#[derive(Debug, Default)]
pub struct Collected {
    /// `{type: stdout|stderr, text}`, `{type: result|display, data}`, `{type: exception,
    /// name, value, traceback}`, in order (neighbouring text of one stream merged).
    pub outputs: Vec<Value>,
    /// Bytes kept so far.
    pub bytes: usize,
    /// Whether output was dropped at [`OUTPUT_CAP`].
    pub truncated: bool,
}

impl Collected {
    /// Takes one event of `run_code` or `exec`.
    pub fn push(&mut self, ev: &EventKind) {
        if self.truncated {
            return;
        }
        let v = match ev {
            EventKind::Stdout { data } | EventKind::Stderr { data } => {
                let kind = if matches!(ev, EventKind::Stdout { .. }) {
                    "stdout"
                } else {
                    "stderr"
                };
                let text = String::from_utf8_lossy(data).into_owned();
                if self.take(text.len()) {
                    return;
                }
                if let Some(last) = self.outputs.last_mut() {
                    if last["type"] == kind {
                        let joined = format!("{}{}", last["text"].as_str().unwrap_or(""), text);
                        last["text"] = Value::String(joined);
                        return;
                    }
                }
                json!({"type": kind, "text": text})
            }
            EventKind::Result(r) => json!({"type": "result", "data": r.data}),
            EventKind::Display(d) => json!({"type": "display", "data": d.data}),
            EventKind::Exception(e) => json!({
                "type": "exception", "name": e.name, "value": e.value, "traceback": e.traceback,
            }),
            EventKind::Truncated { limit } => json!({"type": "truncated", "limit": limit}),
            _ => return,
        };
        let n = v.to_string().len();
        if !self.take(n) {
            self.outputs.push(v);
        }
    }

    /// Counts `n` more bytes; true (and marks it) when that passes the cap.
    fn take(&mut self, n: usize) -> bool {
        if self.bytes + n > OUTPUT_CAP {
            self.truncated = true;
            self.outputs
                .push(json!({"type": "truncated", "limit": OUTPUT_CAP}));
            return true;
        }
        self.bytes += n;
        false
    }
}

/// A cell: Python code.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CodeBody {
    code: String,
}

/// `POST /ui/api/sandboxes/{id}/code`: runs the cell in the default Python context (a
/// `run_code` call) and answers every output once it ended.
async fn run_code(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<CodeBody>,
) -> Result<Json<Value>, ApiError> {
    let b = st.backend();
    let job = st.spawn(move |_| {
        let mut out = Collected::default();
        let req = RunCodeRequest {
            timeout_ms: Some(CALL_TIMEOUT_MS),
            output_cap: Some(OUTPUT_CAP as u64),
            ..RunCodeRequest::new(body.code)
        };
        let end = b.call(
            call::RunCode { id, req },
            Io::events(&mut |ev| {
                out.push(ev);
                true
            }),
        )?;
        Ok(json!({"outputs": out.outputs, "end": end}))
    });
    AppState::join(job).await.map(Json)
}

/// A command line, run by `/bin/sh -c`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ExecBody {
    command: String,
}

/// `POST /ui/api/sandboxes/{id}/exec`: runs the command (an `exec` call of `/bin/sh -c`)
/// and answers its output and exit status once it ended.
async fn exec(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<ExecBody>,
) -> Result<Json<Value>, ApiError> {
    if body.command.trim().is_empty() {
        return Err(ApiError::invalid("the command is empty"));
    }
    let b = st.backend();
    let job = st.spawn(move |_| {
        let mut out = Collected::default();
        let mut exit = None;
        let req = ExecRequest {
            argv: vec!["/bin/sh".into(), "-c".into(), body.command],
            timeout_ms: Some(CALL_TIMEOUT_MS),
            ..Default::default()
        };
        let status = b.call(
            call::Exec { id, req },
            Io::events(&mut |ev| {
                if let EventKind::Exit(s) = ev {
                    exit = Some(*s);
                }
                out.push(ev);
                true
            }),
        )?;
        Ok(json!({"outputs": out.outputs, "status": status, "exit": exit}))
    });
    AppState::join(job).await.map(Json)
}

/// `?path=` of an artifact download.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ArtifactQuery {
    path: String,
}

/// `GET /ui/api/sandboxes/{id}/artifact?path=`: the artifact's bytes, as an attachment.
async fn artifact(
    State(st): State<AppState>,
    Path(id): Path<String>,
    Query(q): Query<ArtifactQuery>,
) -> Response {
    let b = st.backend();
    let name = q
        .path
        .rsplit('/')
        .next()
        .unwrap_or("artifact")
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || "._-".contains(*c))
        .collect::<String>();
    let mut resp = stream::raw(
        move |w| {
            b.call(call::ReadArtifact { id, path: q.path }, Io::output(w))?;
            Ok(())
        },
        None,
    )
    .await;
    if resp.status().is_success() {
        let disposition = format!(
            "attachment; filename=\"{}\"",
            if name.is_empty() { "artifact" } else { &name }
        );
        if let Ok(v) = HeaderValue::from_str(&disposition) {
            resp.headers_mut().insert(header::CONTENT_DISPOSITION, v);
        }
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(id: usize, template: &str) -> SandboxInfo {
        serde_json::from_value(json!({
            "id": format!("{id:016x}"), "template": template, "snapshot": null,
            "forked_from": null, "state": "running", "reason": null,
            "created_at": "2026-12-06T00:00:00Z", "ends_at": null, "max_until": null,
            "on_timeout": "kill",
            "resources": {"vcpus": 1, "memory_mib": 256, "disk_mib": 1024,
                "memory_limit_mib": 300, "cpu_percent": null, "pids_max": 100},
            "metadata": {}, "env": {}, "pid": null, "start_ms": null,
        }))
        .unwrap()
    }

    #[test]
    fn pages_hold_at_most_fifty_and_filter_by_template() {
        let all: Vec<_> = (0..1000)
            .map(|i| info(i, if i % 4 == 0 { "python-data" } else { "default" }))
            .collect();
        let p = paginate(all.clone(), None, 0);
        assert_eq!((p.total, p.items.len(), p.per_page), (1000, 50, 50));
        assert_eq!(p.templates, vec!["default", "python-data"]);
        let p = paginate(all.clone(), Some("python-data"), 4);
        assert_eq!((p.total, p.page, p.items.len()), (250, 4, 50));
        assert_eq!(p.items[0].id, format!("{:016x}", 800));
        // Past the end: the last page.
        let p = paginate(all.clone(), Some("python-data"), 99);
        assert_eq!(p.page, 4);
        let p = paginate(Vec::new(), None, 3);
        assert_eq!((p.total, p.page, p.items.len()), (0, 0, 0));
    }

    #[test]
    fn metadata_filter_pairs() {
        let m = metadata_filter(Some(" team=a , run = 7,")).unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!((m["team"].as_str(), m["run"].as_str()), ("a", "7"));
        assert!(metadata_filter(None).unwrap().is_empty());
        assert!(metadata_filter(Some("novalue")).is_err());
        assert!(metadata_filter(Some("=v")).is_err());
    }

    #[test]
    fn state_filter_choices() {
        assert!(!list_filter(None).unwrap().all);
        assert!(list_filter(Some("all")).unwrap().all);
        assert_eq!(
            list_filter(Some("paused")).unwrap().state,
            Some(SandboxState::Paused)
        );
        assert!(list_filter(Some("sleeping")).is_none());
    }

    #[test]
    fn output_is_merged_per_stream_and_capped() {
        let mut c = Collected::default();
        c.push(&EventKind::Stdout {
            data: b"h".to_vec(),
        });
        c.push(&EventKind::Stdout {
            data: b"i\n".to_vec(),
        });
        c.push(&EventKind::Stderr {
            data: b"e".to_vec(),
        });
        assert_eq!(c.outputs.len(), 2);
        assert_eq!(c.outputs[0]["text"], "hi\n");
        let big = vec![b'x'; OUTPUT_CAP];
        c.push(&EventKind::Stdout { data: big });
        c.push(&EventKind::Stdout {
            data: b"more".to_vec(),
        });
        assert!(c.truncated);
        assert_eq!(c.outputs.last().unwrap()["type"], "truncated");
        assert!(c.bytes <= OUTPUT_CAP);
    }

    /// A request to the fake-backed router with the session cookie and CSRF token given.
    fn ui_req(method: &str, uri: &str, cookie: Option<&str>, csrf: Option<&str>) -> Request {
        let mut b = Request::builder().method(method).uri(uri);
        if let Some(c) = cookie {
            b = b.header("cookie", format!("other=1; {}={c}", session::COOKIE));
        }
        if let Some(t) = csrf {
            b = b.header(CSRF_HEADER, t);
        }
        b.body(axum::body::Body::empty()).unwrap()
    }

    #[tokio::test]
    async fn sign_in_sessions_csrf_and_sign_out_over_the_router() {
        use crate::tests::{send, Fake, KNOWN, TOKEN};
        let app = crate::router(AppState::new(
            std::sync::Arc::new(Fake::default()),
            TOKEN.into(),
        ));
        // The page itself needs nothing, and forbids scripts from elsewhere.
        let (s, h, body) = send(&app, ui_req("GET", "/ui/", None, None)).await;
        assert_eq!(s, StatusCode::OK);
        assert!(String::from_utf8_lossy(&body).contains("/ui/app.js"));
        assert!(String::from_utf8_lossy(&body).contains("/ui/vendor/xterm.js"));
        let csp = h["content-security-policy"].to_str().unwrap();
        assert!(csp.contains("script-src 'self'"), "{csp}");
        let (s, _, _) = send(&app, ui_req("GET", "/ui/app.js", None, None)).await;
        assert_eq!(s, StatusCode::OK);
        // The style nonce is fresh per page and the same in the page and its CSP.
        let nonce = csp
            .split("'nonce-")
            .nth(1)
            .unwrap()
            .split('\'')
            .next()
            .unwrap();
        assert_eq!(nonce.len(), 64);
        assert!(String::from_utf8_lossy(&body).contains(&format!("content=\"{nonce}\"")));
        // The vendored terminal, embedded, with its content types.
        for (path, ct, needle) in [
            ("/ui/vendor/xterm.js", "text/javascript", "Terminal"),
            ("/ui/vendor/addon-fit.js", "text/javascript", "FitAddon"),
            ("/ui/vendor/xterm.css", "text/css", ".xterm"),
        ] {
            let (s, h, body) = send(&app, ui_req("GET", path, None, None)).await;
            assert_eq!(s, StatusCode::OK, "{path}");
            assert_eq!(h["content-type"], ct, "{path}");
            assert!(String::from_utf8_lossy(&body).contains(needle), "{path}");
        }
        // The terminal: the session first (401), then Origin and the CSRF subprotocol (403).
        let term = format!("/ui/api/sandboxes/{KNOWN}/terminal");
        let (s, _, _) = send(&app, ui_req("GET", &term, None, None)).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED);
        // No session: 401 on data, before any call.
        let (s, _, _) = send(&app, ui_req("GET", "/ui/api/overview", None, None)).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED);
        let (s, _, _) = send(
            &app,
            ui_req("GET", "/ui/api/overview", Some("forged"), None),
        )
        .await;
        assert_eq!(s, StatusCode::UNAUTHORIZED);
        // A wrong token: back to the form, no cookie.
        let login = |token: &str| {
            Request::builder()
                .method("POST")
                .uri("/ui/login")
                .header("content-type", "application/x-www-form-urlencoded")
                .body(axum::body::Body::from(format!("token={token}")))
                .unwrap()
        };
        let (s, h, _) = send(&app, login("wrong")).await;
        assert_eq!(s, StatusCode::SEE_OTHER);
        assert_eq!(h["location"], "/ui/?signin=failed");
        assert!(h.get("set-cookie").is_none());
        // The right one: a cookie that is not the token.
        let (s, h, _) = send(&app, login(TOKEN)).await;
        assert_eq!(s, StatusCode::SEE_OTHER);
        assert_eq!(h["location"], "/ui/");
        let set = h["set-cookie"].to_str().unwrap().to_string();
        assert!(
            set.contains("HttpOnly") && set.contains("SameSite=Strict"),
            "{set}"
        );
        assert!(!set.contains(TOKEN));
        let id = session::cookie_value(set.split(';').next().unwrap())
            .unwrap()
            .to_string();
        let (s, _, body) = send(&app, ui_req("GET", "/ui/api/session", Some(&id), None)).await;
        assert_eq!(s, StatusCode::OK);
        let csrf = serde_json::from_slice::<Value>(&body).unwrap()["csrf"]
            .as_str()
            .unwrap()
            .to_string();
        // Reads need the session only; actions the CSRF token too.
        let (s, _, body) = send(&app, ui_req("GET", "/ui/api/sandboxes", Some(&id), None)).await;
        assert_eq!(s, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
        let pause = format!("/ui/api/sandboxes/{KNOWN}/pause");
        let (s, _, _) = send(&app, ui_req("POST", &pause, Some(&id), None)).await;
        assert_eq!(s, StatusCode::FORBIDDEN);
        let (s, _, _) = send(&app, ui_req("POST", &pause, Some(&id), Some("nope"))).await;
        assert_eq!(s, StatusCode::FORBIDDEN);
        // With it, the call reaches the backend (the fake's sandbox has ended: 409).
        let (s, _, body) = send(&app, ui_req("POST", &pause, Some(&id), Some(&csrf))).await;
        assert_eq!(
            s,
            StatusCode::CONFLICT,
            "{}",
            String::from_utf8_lossy(&body)
        );
        assert!(String::from_utf8_lossy(&body).contains("wrong_state"));
        // The terminal's WebSocket: a foreign or missing Origin, or no CSRF subprotocol: 403.
        let ws = |origin: Option<&str>, protocols: &str| {
            let mut b = Request::builder()
                .method("GET")
                .uri(&term)
                .header("host", "127.0.0.1:3000")
                .header("cookie", format!("{}={id}", session::COOKIE))
                .header("sec-websocket-protocol", protocols);
            if let Some(o) = origin {
                b = b.header("origin", o);
            }
            b.body(axum::body::Body::empty()).unwrap()
        };
        let good = format!("ember-terminal, csrf.{csrf}");
        let (s, _, body) = send(&app, ws(Some("http://evil.example"), &good)).await;
        assert_eq!(s, StatusCode::FORBIDDEN);
        assert!(String::from_utf8_lossy(&body).contains("origin"));
        let (s, _, _) = send(&app, ws(None, &good)).await;
        assert_eq!(s, StatusCode::FORBIDDEN);
        let origin = Some("http://127.0.0.1:3000");
        let (s, _, body) = send(&app, ws(origin, "ember-terminal")).await;
        assert_eq!(s, StatusCode::FORBIDDEN);
        assert!(String::from_utf8_lossy(&body).contains("csrf"));
        let (s, _, _) = send(&app, ws(origin, "ember-terminal, csrf.nope")).await;
        assert_eq!(s, StatusCode::FORBIDDEN);
        // Both right: past the checks (not a real upgrade here, so not 101, nor 401/403).
        let (s, _, _) = send(&app, ws(origin, &good)).await;
        assert!(
            s != StatusCode::FORBIDDEN && s != StatusCode::UNAUTHORIZED,
            "{s}"
        );
        // The cookie is not the API's credential.
        let (s, _, _) = send(&app, ui_req("GET", "/v1/sandboxes", Some(&id), None)).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED);
        // Sign-out needs the CSRF token, ends the session and clears the cookie.
        let (s, _, _) = send(&app, ui_req("POST", "/ui/logout", Some(&id), None)).await;
        assert_eq!(s, StatusCode::FORBIDDEN);
        let (s, h, _) = send(&app, ui_req("POST", "/ui/logout", Some(&id), Some(&csrf))).await;
        assert_eq!(s, StatusCode::OK);
        assert!(h["set-cookie"].to_str().unwrap().contains("Max-Age=0"));
        let (s, _, _) = send(&app, ui_req("GET", "/ui/api/session", Some(&id), None)).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED);
    }

    #[tokio::test]
    async fn template_build_streams_its_log_and_errors_behind_csrf() {
        use crate::tests::{send, Fake, TOKEN};
        let st = AppState::new(std::sync::Arc::new(Fake::default()), TOKEN.into());
        let app = crate::router(st.clone());
        let s = st.inner.ui.sign_in(TOKEN, TOKEN, Instant::now()).unwrap();
        let build = |name: &str, csrf: Option<&str>| {
            ui_req(
                "POST",
                &format!("/ui/api/templates/{name}/build"),
                Some(&s.id),
                csrf,
            )
        };
        let (status, _, _) = send(&app, build("default", None)).await;
        assert_eq!(status, StatusCode::FORBIDDEN);
        let lines = |body: &[u8]| -> Vec<Value> {
            String::from_utf8_lossy(body)
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect()
        };
        let (status, _, body) = send(&app, build("default", Some(&s.csrf))).await;
        assert_eq!(status, StatusCode::OK);
        let got = lines(&body);
        assert_eq!(got[0]["type"], "step", "{got:?}");
        assert_eq!(got.last().unwrap()["type"], "done", "{got:?}");
        assert_eq!(got.last().unwrap()["template"]["name"], "default");
        // A failing build: its progress, then the error as the last line.
        let (_, _, body) = send(&app, build("broken", Some(&s.csrf))).await;
        let got = lines(&body);
        assert_eq!(got.last().unwrap()["type"], "error", "{got:?}");
        assert!(got.last().unwrap()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("boom"));
    }

    #[test]
    fn only_ui_paths_leave_the_bearer_check() {
        assert!(is_ui_path("/ui") && is_ui_path("/ui/") && is_ui_path("/ui/api/overview"));
        assert!(!is_ui_path("/uix") && !is_ui_path("/v1/ui") && !is_ui_path("/"));
    }
}
