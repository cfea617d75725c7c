//! ember's HTTP server (`ember serve`) and its client.
//!
//! The native HTTP API: REST + NDJSON streams over the [`Runtime`], with an
//! OpenAPI document (`/openapi.json`). See `docs/api.md`.
//!
//! - `routes`: one handler per route; each makes one runtime call on a blocking thread.
//!   A route is declared once, by its handler's `#[utoipa::path]`; `table` (below) lists the
//!   handlers, and the router and the OpenAPI document's paths are both built from that list.
//! - `stream`: blocking calls → response bodies (NDJSON events, file bytes) and request
//!   bodies → blocking readers, through bounded channels; a client that goes away stops the
//!   guest work.
//! - `error`: the `{"error":{"code","message"}}` shape and status mapping.
//! - `backend`: the runtime's calls as a trait, so this layer is testable without VMs.
//! - `mcp`: `/mcp`, the sandboxes as MCP tools (streamable HTTP) over the same backend.
//! - `ui`: the web dashboard at `/ui` (embedded page, session cookie + CSRF token) over the
//!   same backend.
//! - `metrics`, `openapi`, `types`: `/metrics`, the document, the API's own bodies.
//!
//! Around every route: a request id (`x-request-id`, the client's if it sent a sane one), a
//! tracing span with method, path, status and latency, a request counter for `/metrics`,
//! then the E2B dispatch (`e2b::route`: E2B control-plane and sandbox traffic is answered
//! by `e2b`, with its own auth), then bearer-token auth (except `/healthz`,
//! `/openapi.json`, the proxies and `/ui`, which check their own credentials).

pub mod backend;
pub mod browser;
pub mod client;
pub mod e2b;
pub mod error;
pub mod mcp;
pub mod metrics;
pub mod openapi;
pub mod ports;
pub mod proxy;
pub mod routes;
pub mod secrets;
pub mod stream;
pub mod tokens;
pub mod types;
pub mod ui;
pub mod volumes;

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use axum::extract::{MatchedPath, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::Router;
use tracing::{Instrument, Span};
use utoipa::openapi::path::Paths;
use utoipa_axum::router::{OpenApiRouter, UtoipaMethodRouter};
use utoipa_axum::routes;

pub use backend::Backend;
pub use error::ApiError;

use ember_runtime::{Runtime, RuntimeError};
use metrics::HttpCounts;

/// Paths served without a token.
pub const PUBLIC_PATHS: [&str; 2] = ["/healthz", "/openapi.json"];

/// Where and how to serve.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Address to listen on (default `127.0.0.1:7070`).
    pub listen: SocketAddr,
    /// The bearer token's file (default `$EMBER_HOME/token`): created with a random token,
    /// mode 0600, when it does not exist.
    pub token_file: PathBuf,
    /// After SIGINT/SIGTERM, how long open requests (streams) may go on before the server
    /// stops anyway (default 10 s). Sandboxes are left running either way.
    pub shutdown_grace: Duration,
    /// The E2B-compatible surface's settings (domain, template aliases).
    pub e2b: e2b::E2bOptions,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            listen: SocketAddr::from(([127, 0, 0, 1], 7070)),
            token_file: ember_runtime::paths::home_dir().join("token"),
            shutdown_grace: Duration::from_secs(10),
            e2b: e2b::E2bOptions::default(),
        }
    }
}

/// Why the server could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The token file could not be read or created.
    #[error("token file {path}: {message}")]
    Token {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// The address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// Serving failed.
    #[error("serving: {0}")]
    Serve(std::io::Error),
}

/// The server's shared state: the backend, the token, request counts and the rendered
/// OpenAPI document. Cheap to clone.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Shared>,
}

struct Shared {
    backend: Arc<dyn Backend>,
    token: String,
    http: Mutex<HttpCounts>,
    openapi: String,
    e2b: Arc<e2b::E2bOptions>,
    rpc: Arc<e2b::rpc::RpcState>,
    ui: ui::session::Sessions,
    ui_usage: ui::resources::Rings,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState").finish_non_exhaustive()
    }
}

impl AppState {
    /// State over `backend`, accepting `token`, with the E2B surface's default settings.
    pub fn new(backend: Arc<dyn Backend>, token: String) -> Self {
        Self::with_e2b(backend, token, e2b::E2bOptions::default())
    }

    /// State over `backend`, accepting `token`, with these E2B settings.
    pub fn with_e2b(backend: Arc<dyn Backend>, token: String, e2b: e2b::E2bOptions) -> Self {
        AppState {
            inner: Arc::new(Shared {
                backend,
                token,
                http: Mutex::new(HttpCounts::new()),
                openapi: openapi::json(),
                e2b: Arc::new(e2b),
                rpc: Arc::new(e2b::rpc::RpcState::default()),
                ui: ui::session::Sessions::default(),
                ui_usage: ui::resources::Rings::default(),
            }),
        }
    }

    /// The backend.
    pub fn backend(&self) -> Arc<dyn Backend> {
        self.inner.backend.clone()
    }

    /// Starts `f` on a blocking thread (in the request's span).
    pub fn spawn<T: Send + 'static>(
        &self,
        f: impl FnOnce(&dyn Backend) -> Result<T, RuntimeError> + Send + 'static,
    ) -> tokio::task::JoinHandle<Result<T, RuntimeError>> {
        let b = self.backend();
        let span = Span::current();
        tokio::task::spawn_blocking(move || {
            let _enter = span.enter();
            f(&*b)
        })
    }

    /// The result of a [`AppState::spawn`]ed call.
    pub async fn join<T>(
        job: tokio::task::JoinHandle<Result<T, RuntimeError>>,
    ) -> Result<T, ApiError> {
        match job.await {
            Ok(r) => r.map_err(ApiError::from),
            Err(e) => Err(ApiError::internal(format!("the call failed: {e}"))),
        }
    }

    /// Runs `f` on a blocking thread and waits for it.
    pub async fn call<T: Send + 'static>(
        &self,
        f: impl FnOnce(&dyn Backend) -> Result<T, RuntimeError> + Send + 'static,
    ) -> Result<T, ApiError> {
        Self::join(self.spawn(f)).await
    }

    /// Requests answered so far, by route and status.
    pub fn http_counts(&self) -> HttpCounts {
        self.inner
            .http
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn count(&self, route: String, status: StatusCode) {
        *self
            .inner
            .http
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry((route, status.as_u16()))
            .or_default() += 1;
    }
}

/// The native routes being assembled: the router with its OpenAPI document, and each route
/// as axum matches it (method, path), which [`route_list`] hands to the tests that send a
/// request to every route.
struct Table {
    api: OpenApiRouter<AppState>,
    routes: Vec<(&'static str, String)>,
}

impl Table {
    /// Adds the handlers of one path (one `routes!`): each is routed at the path and methods
    /// of its `#[utoipa::path]` and documented as that attribute says.
    fn add(mut self, routes: UtoipaMethodRouter<AppState>) -> Self {
        let path = Self::only_path(&routes.1);
        self.record(&path, &routes.1);
        self.api = self.api.routes(routes);
        self
    }

    /// Like [`Table::add`], but the path's last segment, the parameter `{param}`, is routed
    /// as axum's catch-all `{*param}` (the rest of the path, slashes included). OpenAPI has no
    /// catch-all parameter, so the document keeps the attribute's `{param}`; `routes!` would
    /// route that literally, one segment only, hence the route is added by hand here, from
    /// the same attribute.
    fn add_catch_all(mut self, param: &str, routes: UtoipaMethodRouter<AppState>) -> Self {
        let (schemas, paths, method_router) = routes;
        let path = Self::only_path(&paths);
        let documented = format!("/{{{param}}}");
        let Some(prefix) = path.strip_suffix(&documented) else {
            panic!("{path} does not end with {documented}");
        };
        let routed = format!("{prefix}/{{*{param}}}");
        self.record(&routed, &paths);
        self.api = self.api.route(&routed, method_router);
        let doc = self.api.get_openapi_mut();
        doc.paths.merge(paths);
        doc.components
            .get_or_insert_with(Default::default)
            .schemas
            .extend(schemas);
        self
    }

    /// The one path of a `routes!`: `OpenApiRouter::routes` would route every handler of
    /// the list on every path of it, so a list may only group the methods of one path.
    fn only_path(paths: &Paths) -> String {
        let mut keys = paths.paths.keys();
        match (keys.next(), keys.next()) {
            (Some(path), None) => path.clone(),
            _ => panic!(
                "one routes!(..) per path, got {:?}",
                paths.paths.keys().collect::<Vec<_>>()
            ),
        }
    }

    /// Remembers the methods `paths` documents, as routed at `path`.
    fn record(&mut self, path: &str, paths: &Paths) {
        for item in paths.paths.values() {
            let methods = [
                ("GET", &item.get),
                ("PUT", &item.put),
                ("POST", &item.post),
                ("DELETE", &item.delete),
                ("OPTIONS", &item.options),
                ("HEAD", &item.head),
                ("PATCH", &item.patch),
                ("TRACE", &item.trace),
            ];
            for (method, operation) in methods {
                if operation.is_some() {
                    self.routes.push((method, path.to_string()));
                }
            }
        }
    }
}

/// The native API's routes, each declared once: a handler's `#[utoipa::path]` gives its
/// path and method to both the axum router and the OpenAPI document (`routes!`), so the two
/// cannot drift apart. One `routes!` per path, grouping that path's methods. The paths are
/// added to `doc` ([`openapi::ApiDoc`] for the served document, an empty one when only the
/// router or the list is wanted). The proxy, browser and E2B routes are added in [`router`],
/// outside the document.
pub(crate) fn table(doc: utoipa::openapi::OpenApi) -> Table {
    use routes as r;
    let t = Table {
        api: OpenApiRouter::with_openapi(doc),
        routes: Vec::new(),
    };
    t.add(routes!(r::healthz))
        .add(routes!(r::openapi))
        .add(routes!(r::metrics))
        .add(routes!(r::list_templates))
        .add(routes!(r::build_template))
        .add(routes!(r::create, r::list_sandboxes))
        .add(routes!(r::get_sandbox, r::kill))
        .add(routes!(r::pause))
        .add(routes!(r::resume))
        .add(routes!(r::set_timeout))
        .add(routes!(r::history))
        .add(routes!(r::fork))
        .add(routes!(r::snapshot))
        .add(routes!(r::list_snapshots))
        .add(routes!(r::delete_snapshot))
        .add(routes!(r::list_contexts, r::create_context))
        .add(routes!(r::restart_context))
        .add(routes!(r::remove_context))
        .add(routes!(r::interrupt))
        .add(routes!(r::run_code))
        .add(routes!(r::exec))
        .add(routes!(r::upload, r::download, r::remove))
        .add(routes!(r::list_files))
        .add(routes!(r::stat))
        .add(routes!(r::mkdir))
        .add(routes!(r::rename))
        .add(routes!(r::list_artifacts))
        .add(routes!(r::collect_artifacts))
        // Any file under the outputs directory: axum's catch-all `{*path}`, added by hand
        // from the attribute (`Table::add_catch_all`); the document keeps `{path}`.
        .add_catch_all("path", routes!(r::get_artifact))
        .add(routes!(r::sandbox_audit))
        .add(routes!(ports::get_network, ports::set_network))
        .add(routes!(ports::expose))
        .add(routes!(ports::unexpose))
        .add(routes!(r::audit))
        .add(routes!(secrets::create_secret, secrets::list_secrets))
        .add(routes!(secrets::rotate_secret, secrets::delete_secret))
        .add(routes!(volumes::create_volume, volumes::list_volumes))
        .add(routes!(volumes::get_volume, volumes::delete_volume))
        .add(routes!(
            volumes::read_volume_file,
            volumes::write_volume_file,
            volumes::remove_volume_path
        ))
        .add(routes!(volumes::list_volume_files))
        .add(routes!(volumes::stat_volume_path))
        .add(routes!(volumes::mkdir_volume))
        .add(routes!(volumes::rename_volume_path))
}

/// The routes as (method, path), in axum's path syntax. The paths come out of the
/// attributes at run time, so the list is built once and kept for the `'static` strings.
pub fn route_list() -> Vec<(&'static str, &'static str)> {
    static ROUTES: OnceLock<Vec<(&'static str, String)>> = OnceLock::new();
    ROUTES
        .get_or_init(|| table(Default::default()).routes)
        .iter()
        .map(|(method, path)| (*method, path.as_str()))
        .collect()
}

/// The whole application: routes, auth, request ids, logs, counters, JSON errors, and the
/// E2B surface in front of the native routes.
pub fn router(state: AppState) -> Router {
    // The document is rendered once per state (`AppState::with_e2b`), not from here.
    let (native, _) = table(Default::default()).api.split_for_parts();
    // The dashboard (`/ui`): its own session auth, its data through the same backend.
    ui::routes(browser::routes(native), state.clone())
        // The reverse proxy to exposed guest ports: any method, authorized by `ports`.
        .route(
            "/v1/sandboxes/{id}/ports/{port}/",
            axum::routing::any(ports::proxy_root),
        )
        .route(
            "/v1/sandboxes/{id}/ports/{port}/{*rest}",
            axum::routing::any(ports::proxy_rest),
        )
        // MCP (streamable HTTP): the tools over the same backend, behind the same token.
        .route_service("/mcp", mcp::service(state.clone()))
        .fallback(error::no_route)
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        .layer(middleware::from_fn_with_state(
            e2b::Surface::new(state.clone()),
            e2b::route::dispatch,
        ))
        .layer(middleware::from_fn_with_state(state.clone(), observe))
        .with_state(state)
}

/// Constant-time comparison (the token is a secret).
pub(crate) fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Bearer-token auth on everything but [`PUBLIC_PATHS`], the proxies (their own tokens) and
/// the dashboard (its session cookie, `ui`).
async fn auth(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    if PUBLIC_PATHS.contains(&path)
        || ports::is_proxy_path(path)
        || browser::is_browser_path(path)
        || ui::is_ui_path(path)
    {
        return next.run(req).await;
    }
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, token) = v.trim().split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
        });
    match given {
        Some(t) if same(t.as_bytes(), st.inner.token.as_bytes()) => next.run(req).await,
        Some(_) => unauthorized("wrong bearer token"),
        None => unauthorized(
            "missing bearer token (send `Authorization: Bearer <token>`; the server's token is \
             in $EMBER_HOME/token)",
        ),
    }
}

fn unauthorized(message: &str) -> Response {
    let mut resp = ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", message).into_response();
    resp.headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    resp
}

/// A client's request id, if it is short and printable.
fn client_request_id(req: &Request) -> Option<String> {
    let v = req.headers().get("x-request-id")?.to_str().ok()?;
    let ok = !v.is_empty()
        && v.len() <= 128
        && v.bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"-_.:/+=".contains(&c));
    ok.then(|| v.to_string())
}

/// Request id, span, log line, counter, JSON errors.
async fn observe(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let id = client_request_id(&req).unwrap_or_else(ember_runtime::paths::random_id);
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|m| m.as_str().to_string())
        .unwrap_or_else(|| "unmatched".into());
    let method = req.method().to_string();
    let path = req.uri().path().to_string();
    let span = tracing::info_span!("request", id = %id, method = %method, path = %path);
    let t0 = Instant::now();
    let resp = next.run(req).instrument(span.clone()).await;
    // The E2B surface answers in its own shapes; its routes are counted by surface.
    let (route, mut resp) = match resp.extensions().get::<e2b::E2bRoute>().copied() {
        Some(e2b::E2bRoute(label)) => (label.to_string(), resp),
        None => (route, error::jsonify(resp, &method, &path).await),
    };
    let status = resp.status();
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    span.in_scope(|| {
        if status.is_server_error() {
            tracing::warn!(status = status.as_u16(), ms, "answered");
        } else {
            tracing::info!(status = status.as_u16(), ms, "answered");
        }
    });
    st.count(route, status);
    if let Ok(v) = HeaderValue::from_str(&id) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

/// 32 random bytes as hex.
fn random_token() -> std::io::Result<String> {
    use std::io::Read;
    let mut b = [0u8; 32];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// Reads the token from `path`, creating the file (mode 0600, a random token) when it does
/// not exist.
pub fn load_or_create_token(path: &Path) -> Result<String, ServeError> {
    use std::io::Write;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let err = |message: String| ServeError::Token {
        path: path.to_path_buf(),
        message,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)
            .map_err(|e| err(format!("cannot create its directory: {e}")))?;
    }
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
    {
        Ok(mut f) => {
            let token = random_token().map_err(|e| err(format!("cannot make a token: {e}")))?;
            f.write_all(format!("{token}\n").as_bytes())
                .and_then(|_| f.sync_all())
                .map_err(|e| err(format!("cannot write: {e}")))?;
            tracing::info!("created a new API token in {}", path.display());
            Ok(token)
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let meta = std::fs::metadata(path).map_err(|e| err(e.to_string()))?;
            if meta.permissions().mode() & 0o077 != 0 {
                tracing::warn!(
                    "{} is readable by other users (mode {:o}); chmod 600 it",
                    path.display(),
                    meta.permissions().mode() & 0o777
                );
            }
            let token = std::fs::read_to_string(path)
                .map_err(|e| err(format!("cannot read: {e}")))?
                .trim()
                .to_string();
            if token.len() < 16 || token.chars().any(|c| c.is_whitespace() || c.is_control()) {
                return Err(err(
                    "holds no usable token (at least 16 non-space characters); delete it to \
                     get a new one"
                        .into(),
                ));
            }
            Ok(token)
        }
        Err(e) => Err(err(format!("cannot create: {e}"))),
    }
}

/// A future that completes when the server stops.
pub type StopSignal = std::pin::Pin<Box<dyn Future<Output = ()> + Send>>;

/// Another listener serving the same application (e.g. the TLS one): given the router and
/// a [`StopSignal`], it serves until the signal completes.
pub type ExtraListener = Box<
    dyn FnOnce(
            Router,
            StopSignal,
        ) -> std::pin::Pin<Box<dyn Future<Output = std::io::Result<()>> + Send>>
        + Send,
>;

/// A bound server, not yet serving.
pub struct Server {
    listener: tokio::net::TcpListener,
    token: String,
    opts: ServeOptions,
    extra: Vec<(String, ExtraListener)>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("listener", &self.listener)
            .field("opts", &self.opts)
            .field(
                "extra",
                &self.extra.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl Server {
    /// Reads or creates the token and binds the address.
    pub async fn bind(opts: ServeOptions) -> Result<Server, ServeError> {
        let token = load_or_create_token(&opts.token_file)?;
        let listener = tokio::net::TcpListener::bind(opts.listen)
            .await
            .map_err(|source| ServeError::Bind {
                addr: opts.listen,
                source,
            })?;
        Ok(Server {
            listener,
            token,
            opts,
            extra: Vec::new(),
        })
    }

    /// Also serves the application through `listener` (named `name` in logs), started with
    /// the server and stopped with it.
    pub fn also_serve(mut self, name: impl Into<String>, listener: ExtraListener) -> Self {
        self.extra.push((name.into(), listener));
        self
    }

    /// The bound address (the port when `listen` asked for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().unwrap_or(self.opts.listen)
    }

    /// Serves `backend` until SIGINT or SIGTERM.
    pub async fn run(self, backend: Arc<dyn Backend>) -> Result<(), ServeError> {
        self.run_until(backend, shutdown_signal()).await
    }

    /// Serves `backend` until `stop` completes; then open requests get
    /// [`ServeOptions::shutdown_grace`] to finish.
    pub async fn run_until(
        self,
        backend: Arc<dyn Backend>,
        stop: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServeError> {
        let app = router(AppState::with_e2b(
            backend,
            self.token,
            self.opts.e2b.clone(),
        ));
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        for (name, serve) in self.extra {
            let mut rx = stop_rx.clone();
            let signal: StopSignal = Box::pin(async move {
                let _ = rx.wait_for(|stop| *stop).await;
            });
            let fut = serve(app.clone(), signal);
            tokio::spawn(async move {
                if let Err(e) = fut.await {
                    tracing::error!("{name}: stopped serving: {e}");
                }
            });
        }
        let stopping = Arc::new(tokio::sync::Notify::new());
        let notify = stopping.clone();
        let graceful = async move {
            stop.await;
            tracing::info!(
                "shutting down (sandboxes keep running; the next start re-attaches them)"
            );
            let _ = stop_tx.send(true);
            notify.notify_one();
        };
        // Nagle off: the last line of an NDJSON stream must not wait for the client's
        // delayed ACK (36–55 ms per call on a kept-alive connection, measured).
        use axum::serve::ListenerExt;
        let listener = self.listener.tap_io(|s| {
            let _ = s.set_nodelay(true);
        });
        let server = axum::serve(listener, app).with_graceful_shutdown(graceful);
        let grace = self.opts.shutdown_grace;
        tokio::select! {
            r = server => r.map_err(ServeError::Serve),
            _ = async { stopping.notified().await; tokio::time::sleep(grace).await } => {
                tracing::warn!("requests still open after {grace:?}; stopping anyway");
                Ok(())
            }
        }
    }
}

/// Completes on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate_signal() => {}
    }
}

/// Completes on SIGTERM (never, when it cannot be watched: said in the log).
pub async fn terminate_signal() {
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(mut s) => {
            s.recv().await;
        }
        Err(e) => {
            tracing::error!("cannot watch SIGTERM: {e}");
            std::future::pending::<()>().await
        }
    }
}

/// Serves the native API over `rt` until SIGINT/SIGTERM. Sandboxes are left running; the
/// runtime re-attaches them at the next start.
pub async fn serve(rt: Runtime, opts: ServeOptions) -> Result<(), ServeError> {
    let server = Server::bind(opts).await?;
    tracing::info!(
        "listening on http://{} (bearer token in {})",
        server.local_addr(),
        server.opts.token_file.display()
    );
    server.run(Arc::new(rt)).await
}

#[cfg(test)]
pub(crate) mod tests;
