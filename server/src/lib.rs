//! ember's HTTP server (`ember serve`) and its client.
//!
//! The native HTTP API: REST + NDJSON streams over the [`Runtime`], with an
//! OpenAPI document (`/openapi.json`). See `docs/api.md`.
//!
//! - `routes`: one handler per route; each makes one runtime call on a blocking thread.
//! - `stream`: blocking calls → response bodies (NDJSON events, file bytes) and request
//!   bodies → blocking readers, through bounded channels; a client that goes away stops the
//!   guest work.
//! - `error`: the `{"error":{"code","message"}}` shape and status mapping.
//! - `backend`: the runtime's calls as a trait, so this layer is testable without VMs.
//! - `metrics`, `openapi`, `types`: `/metrics`, the document, the API's own bodies.
//!
//! Around every route: a request id (`x-request-id`, the client's if it sent a sane one), a
//! tracing span with method, path, status and latency, a request counter for `/metrics`,
//! then the E2B dispatch (`e2b::route`: E2B control-plane and sandbox traffic is answered
//! by `e2b`, with its own auth), then bearer-token auth (except `/healthz` and
//! `/openapi.json`).

pub mod backend;
pub mod browser;
pub mod client;
pub mod e2b;
pub mod error;
pub mod metrics;
pub mod openapi;
pub mod ports;
pub mod proxy;
pub mod routes;
pub mod stream;
pub mod tokens;
pub mod types;

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{MatchedPath, Request, State};
use axum::handler::Handler;
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{on, MethodFilter};
use axum::Router;
use tracing::{Instrument, Span};

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

/// A router that remembers its routes (method, path), for the OpenAPI check.
struct Table {
    router: Router<AppState>,
    routes: Vec<(&'static str, &'static str)>,
}

impl Table {
    fn add<H, T>(mut self, method: &'static str, path: &'static str, handler: H) -> Self
    where
        H: Handler<T, AppState>,
        T: 'static,
    {
        let filter = match method {
            "GET" => MethodFilter::GET,
            "POST" => MethodFilter::POST,
            "PUT" => MethodFilter::PUT,
            "DELETE" => MethodFilter::DELETE,
            other => panic!("no method filter for {other}"),
        };
        self.router = self.router.route(path, on(filter, handler));
        self.routes.push((method, path));
        self
    }
}

fn table() -> Table {
    use routes as r;
    let t = Table {
        router: Router::new(),
        routes: Vec::new(),
    };
    t.add("GET", "/healthz", r::healthz)
        .add("GET", "/openapi.json", r::openapi)
        .add("GET", "/metrics", r::metrics)
        .add("GET", "/v1/templates", r::list_templates)
        .add("POST", "/v1/templates/{name}/build", r::build_template)
        .add("POST", "/v1/sandboxes", r::create)
        .add("GET", "/v1/sandboxes", r::list_sandboxes)
        .add("GET", "/v1/sandboxes/{id}", r::get_sandbox)
        .add("DELETE", "/v1/sandboxes/{id}", r::kill)
        .add("POST", "/v1/sandboxes/{id}/pause", r::pause)
        .add("POST", "/v1/sandboxes/{id}/resume", r::resume)
        .add("POST", "/v1/sandboxes/{id}/timeout", r::set_timeout)
        .add("GET", "/v1/sandboxes/{id}/history", r::history)
        .add("POST", "/v1/sandboxes/{id}/fork", r::fork)
        .add("POST", "/v1/sandboxes/{id}/snapshot", r::snapshot)
        .add("GET", "/v1/snapshots", r::list_snapshots)
        .add("DELETE", "/v1/snapshots/{name}", r::delete_snapshot)
        .add("GET", "/v1/sandboxes/{id}/contexts", r::list_contexts)
        .add("POST", "/v1/sandboxes/{id}/contexts", r::create_context)
        .add(
            "POST",
            "/v1/sandboxes/{id}/contexts/{ctx}/restart",
            r::restart_context,
        )
        .add(
            "DELETE",
            "/v1/sandboxes/{id}/contexts/{ctx}",
            r::remove_context,
        )
        .add(
            "POST",
            "/v1/sandboxes/{id}/contexts/{ctx}/interrupt",
            r::interrupt,
        )
        .add("POST", "/v1/sandboxes/{id}/code", r::run_code)
        .add("POST", "/v1/sandboxes/{id}/exec", r::exec)
        .add("PUT", "/v1/sandboxes/{id}/files", r::upload)
        .add("GET", "/v1/sandboxes/{id}/files", r::download)
        .add("DELETE", "/v1/sandboxes/{id}/files", r::remove)
        .add("GET", "/v1/sandboxes/{id}/files/list", r::list_files)
        .add("GET", "/v1/sandboxes/{id}/files/stat", r::stat)
        .add("POST", "/v1/sandboxes/{id}/files/mkdir", r::mkdir)
        .add("POST", "/v1/sandboxes/{id}/files/rename", r::rename)
        .add("GET", "/v1/sandboxes/{id}/artifacts", r::list_artifacts)
        .add(
            "POST",
            "/v1/sandboxes/{id}/artifacts/collect",
            r::collect_artifacts,
        )
        .add(
            "GET",
            "/v1/sandboxes/{id}/artifacts/{*path}",
            r::get_artifact,
        )
        .add("GET", "/v1/sandboxes/{id}/audit", r::sandbox_audit)
        .add("GET", "/v1/sandboxes/{id}/network", ports::get_network)
        .add("PUT", "/v1/sandboxes/{id}/network", ports::set_network)
        .add("POST", "/v1/sandboxes/{id}/ports", ports::expose)
        .add("DELETE", "/v1/sandboxes/{id}/ports/{port}", ports::unexpose)
        .add("GET", "/v1/audit", r::audit)
}

/// The routes as (method, path), in axum's path syntax.
pub fn route_list() -> Vec<(&'static str, &'static str)> {
    table().routes
}

/// The whole application: routes, auth, request ids, logs, counters, JSON errors, and the
/// E2B surface in front of the native routes.
pub fn router(state: AppState) -> Router {
    browser::routes(table().router)
        // The reverse proxy to exposed guest ports: any method, authorized by `ports`.
        .route(
            "/v1/sandboxes/{id}/ports/{port}/",
            axum::routing::any(ports::proxy_root),
        )
        .route(
            "/v1/sandboxes/{id}/ports/{port}/{*rest}",
            axum::routing::any(ports::proxy_rest),
        )
        .fallback(error::no_route)
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            e2b::route::dispatch,
        ))
        .layer(middleware::from_fn_with_state(state.clone(), observe))
        .with_state(state)
}

/// Constant-time comparison (the token is a secret).
pub(crate) fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Bearer-token auth on everything but [`PUBLIC_PATHS`].
async fn auth(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    if PUBLIC_PATHS.contains(&path) || ports::is_proxy_path(path) || browser::is_browser_path(path)
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
    let int = tokio::signal::ctrl_c();
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!("cannot watch SIGTERM: {e}");
                std::future::pending::<()>().await
            }
        }
    };
    tokio::select! {
        _ = int => {}
        _ = term => {}
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
