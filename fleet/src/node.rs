//! `ember node`'s side of the fleet: the internal API that takes the runtime's calls from
//! gateways, and the registration and heartbeat that tell the directory the node is there.
//!
//! The internal API listens on its own address, apart from the node's own HTTP API, and
//! takes only the node token (`Authorization: Bearer <node token>`, compared in constant
//! time): it is never open. `POST /internal/v1/call` carries one call in the framing of
//! [`crate::wire`]; `GET /internal/v1/ping` is the gateways' probe; `GET /internal/v1/health`
//! answers 200 while the runtime is up and the node takes work (503 while it drains or is
//! fenced: an engine's readiness check), `GET /internal/v1/live` 200 while it serves at all
//! (its liveness check).
//!
//! Fencing ([`Liveness`], [`start_fence`]): a node that has reached neither the directory
//! nor any gateway for [`FENCE_AFTER`] may be declared lost by the others (who then continue
//! its sandboxes elsewhere or call them lost): it stops the vCPUs of every VM it runs and
//! refuses calls until the directory answers again, and by then has killed what the
//! directory gave away. A node process that freezes cannot do that: its VMMs' watchdogs
//! (`--vmm-watchdog`) stop their own vCPUs when its keep-alives stop.

use std::collections::HashMap;
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use bytes::Bytes;
use ember_runtime::call::{Cancel, CancelOnDrop, EventKind, Handler, Io, Request as Call};
use ember_runtime::Runtime;
use futures_util::StreamExt;
use tokio::sync::mpsc;

use serde::{Deserialize, Serialize};

use crate::blobs::Blobs;
use crate::db::{Db, NodeRecord};
use crate::transfer::NodeHooks;
use crate::wire::{self, kind, WireError};
use crate::FleetError;

/// How often a node heartbeats.
pub const HEARTBEAT: Duration = Duration::from_secs(1);

/// How long a node may reach neither the directory nor any gateway before it fences
/// itself (well inside [`crate::gateway::LOST_AFTER`], after which the others may declare it
/// lost).
pub const FENCE_AFTER: Duration = Duration::from_secs(5);

/// How long a sandbox on this node may stay unknown to the directory before it is killed
/// (a create whose gateway died before recording it; a VM nobody will ever call). A node
/// that starts kills those at once.
pub const UNKNOWN_GRACE: Duration = Duration::from_secs(20);

/// What the node knows of its own standing: when it last reached the directory and when a
/// gateway last reached it, whether it is fenced, whether it drains.
#[derive(Debug)]
pub struct Liveness {
    t0: Instant,
    db_ms: AtomicU64,
    gateway_ms: AtomicU64,
    fenced_at_ms: AtomicU64,
    fenced: AtomicBool,
    draining: AtomicBool,
}

impl Default for Liveness {
    fn default() -> Self {
        Liveness {
            t0: Instant::now(),
            db_ms: AtomicU64::new(0),
            gateway_ms: AtomicU64::new(0),
            fenced_at_ms: AtomicU64::new(0),
            fenced: AtomicBool::new(false),
            draining: AtomicBool::new(false),
        }
    }
}

impl Liveness {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.t0.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// The directory answered a heartbeat (and what it said was acted on).
    pub fn db_reached(&self) {
        self.db_ms.store(self.now_ms(), Ordering::SeqCst);
    }

    /// A gateway reached the internal API with the node token.
    pub fn gateway_reached(&self) {
        self.gateway_ms.store(self.now_ms(), Ordering::SeqCst);
    }

    /// How long since the node last reached the directory or a gateway reached it.
    pub fn silent_for(&self) -> Duration {
        let last = self
            .db_ms
            .load(Ordering::SeqCst)
            .max(self.gateway_ms.load(Ordering::SeqCst));
        Duration::from_millis(self.now_ms().saturating_sub(last))
    }

    /// Whether the node is fenced (its VMs stopped, calls refused).
    pub fn fenced(&self) -> bool {
        self.fenced.load(Ordering::SeqCst)
    }

    /// Whether the node drains (the directory says so).
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    fn set_draining(&self, on: bool) {
        self.draining.store(on, Ordering::SeqCst);
    }
}

/// What the gateways' probe answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Ping {
    /// The node's id.
    pub node: String,
    /// Fenced (it had lost the directory and every gateway; calls are refused until the
    /// directory answers).
    pub fenced: bool,
    /// Draining.
    pub draining: bool,
}

/// What the internal API serves with.
#[derive(Clone)]
struct NodeState {
    handler: Arc<dyn Handler>,
    token: Arc<String>,
    mover: Option<Arc<Mover>>,
    ports: Option<Runtime>,
    live: Arc<Liveness>,
    node: Arc<String>,
}

/// The internal API's router over `handler` (the node's runtime), guarded by `token`;
/// `mover`: what takes in sandboxes that move here (`POST /internal/v1/adopt`), when the
/// node has a blob store; `ports`: the runtime whose guests' ports the data-plane tunnel
/// reaches (`GET /internal/v1/tunnel/{id}/{port}`, an HTTP upgrade); `live`: the node's
/// standing (each authorized request is a gateway reaching it; a fenced node refuses calls).
pub fn router(
    node: &str,
    handler: Arc<dyn Handler>,
    token: String,
    mover: Option<Arc<Mover>>,
    ports: Option<Runtime>,
    live: Arc<Liveness>,
) -> Router {
    let st = NodeState {
        handler,
        token: Arc::new(token),
        mover,
        ports,
        live,
        node: Arc::new(node.to_string()),
    };
    Router::new()
        .route("/internal/v1/call", post(call))
        .route("/internal/v1/adopt", post(adopt))
        .route("/internal/v1/tunnel/{id}/{port}", get(tunnel))
        .route("/internal/v1/ping", get(ping))
        // Every route above takes the node token; the health check below does not.
        .route_layer(axum::middleware::from_fn_with_state(
            st.clone(),
            require_token,
        ))
        .route("/internal/v1/health", get(health))
        .route("/internal/v1/live", get(|| async { StatusCode::OK }))
        .with_state(st)
}

async fn require_token(
    State(st): State<NodeState>,
    req: Request,
    next: axum::middleware::Next,
) -> Response {
    if !authorized(&st, &req) {
        return refuse(
            StatusCode::UNAUTHORIZED,
            "the internal API wants the node token (Authorization: Bearer …)",
        );
    }
    st.live.gateway_reached();
    if st.live.fenced() && req.uri().path() != "/internal/v1/ping" {
        return refuse(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "node {} is fenced: it reached neither the directory nor any gateway for {} s \
                 and stopped its VMs until the directory answers again",
                st.node,
                FENCE_AFTER.as_secs()
            ),
        );
    }
    next.run(req).await
}

/// `GET /internal/v1/ping`: the gateways' probe (a gateway that gets an answer does not
/// declare the node lost; the node counts it as a gateway reaching it).
async fn ping(State(st): State<NodeState>) -> Response {
    axum::Json(Ping {
        node: st.node.to_string(),
        fenced: st.live.fenced(),
        draining: st.live.draining(),
    })
    .into_response()
}

/// `GET /internal/v1/health`: 200 while the node takes work; 503 while it drains or is
/// fenced (an engine's readiness check; its liveness is the process).
async fn health(State(st): State<NodeState>) -> Response {
    if st.live.fenced() {
        refuse(StatusCode::SERVICE_UNAVAILABLE, "fenced")
    } else if st.live.draining() {
        refuse(StatusCode::SERVICE_UNAVAILABLE, "draining")
    } else {
        StatusCode::OK.into_response()
    }
}

/// The upgrade token of the data-plane tunnel.
pub const TUNNEL_PROTOCOL: &str = "ember-tunnel";

/// `GET /internal/v1/tunnel/{id}/{port}?exposed=0|1`: a connection to a guest port, for a
/// gateway's port and CDP proxies. The node connects to the port (resuming the sandbox if
/// paused; with `exposed=1` only if the port is exposed), answers `101 Switching Protocols`
/// and then carries bytes both ways until either side closes. A refusal is the runtime's
/// error as a [`WireError`] (JSON) with its HTTP status.
async fn tunnel(
    State(st): State<NodeState>,
    axum::extract::Path((id, port)): axum::extract::Path<(String, u16)>,
    axum::extract::Query(q): axum::extract::Query<std::collections::HashMap<String, String>>,
    mut req: Request,
) -> Response {
    let Some(rt) = st.ports.clone() else {
        return refuse(
            StatusCode::NOT_IMPLEMENTED,
            "this node serves no guest ports",
        );
    };
    let wants = req
        .headers()
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case(TUNNEL_PROTOCOL));
    if !wants {
        return refuse(
            StatusCode::UPGRADE_REQUIRED,
            format!("the tunnel is an upgrade to {TUNNEL_PROTOCOL}"),
        );
    }
    let exposed = q.get("exposed").is_some_and(|v| v == "1");
    let on_upgrade = hyper::upgrade::on(&mut req);
    let who = id.clone();
    let tcp = tokio::task::spawn_blocking(move || rt.connect_port(&who, port, exposed)).await;
    let tcp = match tcp {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => {
            let status = ember_server::error::status_of(e.class());
            let body = serde_json::to_vec(&WireError::of(&e)).unwrap_or_default();
            return (status, [(header::CONTENT_TYPE, "application/json")], body).into_response();
        }
        Err(e) => {
            return refuse(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("the tunnel: {e}"),
            )
        }
    };
    tokio::spawn(async move {
        let up = match on_upgrade.await {
            Ok(u) => u,
            Err(e) => {
                tracing::debug!("tunnel to {id}:{port}: the upgrade failed: {e}");
                return;
            }
        };
        let mut up = hyper_util::rt::TokioIo::new(up);
        let guest = tcp
            .set_nonblocking(true)
            .and_then(|()| tokio::net::TcpStream::from_std(tcp));
        match guest {
            Ok(mut g) => {
                let _ = tokio::io::copy_bidirectional(&mut up, &mut g).await;
            }
            Err(e) => tracing::debug!("tunnel to {id}:{port}: {e}"),
        }
    });
    Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header(header::CONNECTION, "upgrade")
        .header(header::UPGRADE, TUNNEL_PROTOCOL)
        .body(Body::empty())
        .unwrap_or_default()
}

/// What takes in a paused sandbox that moves to this node.
#[derive(Debug)]
pub struct Mover {
    /// This node's runtime.
    pub rt: Runtime,
    /// The blob store.
    pub blobs: Arc<Blobs>,
    /// The directory.
    pub db: Arc<Db>,
    /// This node's id.
    pub node: String,
    /// Its hooks (which sandboxes are being taken in).
    pub hooks: Arc<NodeHooks>,
}

/// `POST /internal/v1/adopt`: what a gateway asks of the node a paused sandbox moves to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdoptRequest {
    /// The sandbox.
    pub id: String,
    /// The node it was paused on.
    pub from: String,
    /// Its uploaded snapshot (a bundle).
    pub blob: String,
}

/// What the node answers an adopt with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdoptReply {
    /// The sandbox, paused here.
    pub sandbox: ember_runtime::SandboxInfo,
    /// What moved.
    pub moved: crate::blobs::Moved,
    /// How long the take-in took, ms.
    pub ms: f64,
}

impl Mover {
    /// Takes in paused sandbox `r.id` from its upload, then claims it in the directory (a
    /// compare-and-set: a gateway that moved it elsewhere meanwhile wins, and the copy here
    /// is dropped).
    pub fn adopt(&self, r: &AdoptRequest) -> Result<AdoptReply, FleetError> {
        let t0 = std::time::Instant::now();
        {
            let mut importing = self
                .hooks
                .importing
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            if !importing.insert(r.id.clone()) {
                return Err(FleetError::Blob(format!(
                    "sandbox {} is already moving here",
                    r.id
                )));
            }
        }
        let done = || {
            self.hooks
                .importing
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&r.id);
        };
        let res = (|| {
            if let Ok(info) = self.rt.get(&r.id) {
                if !info.state.is_final() {
                    return Err(FleetError::Blob(format!(
                        "sandbox {} is already here",
                        r.id
                    )));
                }
                // An ended copy from an earlier stay: its records give way.
                self.rt.forget(&r.id, "it moves back here");
            }
            let (info, moved) =
                crate::transfer::import_pause(&self.blobs, &self.rt, &r.id, &r.blob, &r.from)?;
            match self.db.adopt(&r.id, &r.from, &r.blob, &self.node) {
                Ok(true) => Ok(AdoptReply {
                    sandbox: info,
                    moved,
                    ms: t0.elapsed().as_secs_f64() * 1e3,
                }),
                Ok(false) => {
                    self.rt.forget(&r.id, "another node took it first");
                    Err(FleetError::Blob(format!(
                        "sandbox {} changed while it moved (another gateway moved it, or it resumed on node {})",
                        r.id, r.from
                    )))
                }
                Err(e) => {
                    self.rt
                        .forget(&r.id, "the directory did not record the move");
                    Err(e)
                }
            }
        })();
        done();
        res
    }
}

async fn adopt(State(st): State<NodeState>, req: Request) -> Response {
    let Some(mover) = st.mover.clone() else {
        return refuse(
            StatusCode::NOT_IMPLEMENTED,
            "this node has no blob store (--blobs): sandboxes cannot move here",
        );
    };
    let body = match axum::body::to_bytes(req.into_body(), 64 << 10).await {
        Ok(b) => b,
        Err(e) => return refuse(StatusCode::BAD_REQUEST, format!("the body: {e}")),
    };
    let r: AdoptRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return refuse(StatusCode::BAD_REQUEST, format!("the request: {e}")),
    };
    let res = tokio::task::spawn_blocking(move || mover.adopt(&r)).await;
    match res {
        Ok(Ok(reply)) => axum::Json(reply).into_response(),
        Ok(Err(e)) => refuse(StatusCode::CONFLICT, e.to_string()),
        Err(e) => refuse(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("the take-in failed: {e}"),
        ),
    }
}

/// The node's runtime as the internal API serves it: a create of a template or a named
/// snapshot this node does not have pulls it from the blob store first, and a named snapshot
/// taken here is recorded in the directory and uploaded.
#[derive(Debug, Clone)]
pub struct NodeRuntime {
    /// The runtime.
    pub rt: Runtime,
    /// The blob store, if any.
    pub blobs: Option<Arc<Blobs>>,
    /// The directory.
    pub db: Arc<Db>,
    /// The node's hooks (its upload queue).
    pub hooks: Arc<NodeHooks>,
    /// Its standing (a draining node takes no creates and lets no paused sandbox resume).
    pub live: Arc<Liveness>,
}

impl NodeRuntime {
    /// A draining node's refusal of `req`, if it refuses it: creates go elsewhere, and a
    /// sandbox paused here is on its way to another node (its caller waits for the upload
    /// and follows it there) rather than resumed here to be paused again.
    fn drain_refusal(&self, req: &Call) -> Option<ember_runtime::RuntimeError> {
        if !self.live.draining() {
            return None;
        }
        if let Call::Create(_) = req {
            return Some(ember_runtime::RuntimeError::Unavailable(
                "this node drains: it takes no creates".into(),
            ));
        }
        // What does not resume it is answered here.
        if matches!(
            req,
            Call::Get(_) | Call::Kill(_) | Call::Pause(_) | Call::History(_) | Call::GetUsage(_)
        ) {
            return None;
        }
        let id = req.sandbox()?;
        let state = self.rt.get(id).ok()?.state;
        matches!(
            state,
            ember_runtime::State::Paused | ember_runtime::State::Pausing
        )
        .then(|| {
            ember_runtime::RuntimeError::Unavailable(format!(
                "sandbox {id} moves off this draining node: retry (a gateway follows it)"
            ))
        })
    }

    /// Pulls named snapshot `name` when this node lacks it and the directory has its upload.
    fn pull_snapshot(&self, blobs: &Blobs, name: &str) -> Result<(), ember_runtime::RuntimeError> {
        if self.rt.export_snapshot(name).is_ok() {
            return Ok(());
        }
        let Ok(Some((_, _, Some(blob)))) = self.db.snapshot(name) else {
            return Ok(()); // the runtime says it has none
        };
        let t0 = std::time::Instant::now();
        match crate::transfer::import_snapshot(blobs, &self.rt, name, &blob) {
            Ok((_, m)) => {
                tracing::info!(
                    "snapshot {name}: pulled ({} MiB of data, {} KiB fetched) in {:.0} ms",
                    m.data >> 20,
                    m.bytes_moved >> 10,
                    t0.elapsed().as_secs_f64() * 1e3
                );
                Ok(())
            }
            Err(e) => Err(ember_runtime::RuntimeError::Unreachable(format!(
                "snapshot {name} could not be pulled: {e}"
            ))),
        }
    }
}

impl Handler for NodeRuntime {
    fn handle(
        &self,
        req: Call,
        io: Io<'_>,
    ) -> Result<ember_runtime::call::Reply, ember_runtime::RuntimeError> {
        if let Some(e) = self.drain_refusal(&req) {
            return Err(e);
        }
        if let Call::TakeSnapshot(_) = &req {
            let r = self.rt.handle(req, io);
            if let Ok(ember_runtime::call::Reply::TakeSnapshot(info)) = &r {
                if let Ok((_, dir)) = self.rt.export_snapshot(&info.name) {
                    self.hooks.snapshot_taken(info, &dir);
                }
            }
            return r;
        }
        if let (Call::Create(c), Some(blobs)) = (&req, &self.blobs) {
            if let Some(name) = &c.req.snapshot {
                self.pull_snapshot(blobs, name)?;
            } else {
                let name = c.req.template.as_deref().unwrap_or("default");
                if ember_runtime::Template::open(name).is_err() {
                    match crate::transfer::open_or_pull(Some(blobs), name, None) {
                        // The runtime says it is not built, as on one host.
                        Ok(_) | Err(FleetError::Missing(_)) => {}
                        Err(e) => {
                            return Err(ember_runtime::RuntimeError::Unreachable(format!(
                                "template {name} could not be pulled: {e}"
                            )))
                        }
                    }
                }
            }
        }
        self.rt.handle(req, io)
    }
}

fn authorized(st: &NodeState, req: &Request) -> bool {
    let Some(v) = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let Some(t) = v.strip_prefix("Bearer ") else {
        return false;
    };
    crate::same(t.trim().as_bytes(), st.token.as_bytes())
}

fn refuse(status: StatusCode, message: impl Into<String>) -> Response {
    (status, message.into()).into_response()
}

/// One call: the request, its input after it, and the frames of its events, output and
/// reply back.
async fn call(State(st): State<NodeState>, req: Request) -> Response {
    let mut body = req.into_body().into_data_stream();
    // The request: its length, then its JSON (both may span chunks).
    let mut head = Vec::new();
    let mut need = None;
    loop {
        if need.is_none() && head.len() >= 4 {
            let n = u32::from_be_bytes([head[0], head[1], head[2], head[3]]);
            if n > wire::MAX_REQUEST {
                return refuse(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "the call's request is too big",
                );
            }
            need = Some(4 + n as usize);
        }
        if need.is_some_and(|n| head.len() >= n) {
            break;
        }
        match body.next().await {
            Some(Ok(c)) => head.extend_from_slice(&c),
            Some(Err(e)) => return refuse(StatusCode::BAD_REQUEST, format!("the body: {e}")),
            None => return refuse(StatusCode::BAD_REQUEST, "the body ended inside the request"),
        }
    }
    let n = need.unwrap_or(4);
    let request: Call = match serde_json::from_slice(&head[4..n]) {
        Ok(r) => r,
        Err(e) => {
            return refuse(
                StatusCode::BAD_REQUEST,
                format!("the call's request is not one this node knows: {e}"),
            )
        }
    };
    let rest = Bytes::copy_from_slice(&head[n..]);
    // The input: what followed the request, then the rest of the body.
    let (in_tx, in_rx) = mpsc::channel::<std::io::Result<Bytes>>(8);
    let wants_input = matches!(request, Call::WriteFile(_) | Call::StdinWrite(_));
    if wants_input {
        tokio::spawn(async move {
            if !rest.is_empty() && in_tx.send(Ok(rest)).await.is_err() {
                return;
            }
            while let Some(chunk) = body.next().await {
                let item = chunk.map_err(|e| std::io::Error::other(format!("cut off: {e}")));
                let stop = item.is_err();
                if in_tx.send(item).await.is_err() || stop {
                    break;
                }
            }
        });
    }
    let (tx, rx) = mpsc::channel::<Bytes>(32);
    let cancel = Cancel::new();
    let handler = st.handler.clone();
    let thread_cancel = cancel.clone();
    let span = tracing::Span::current();
    tokio::task::spawn_blocking(move || {
        let _enter = span.enter();
        run(
            &*handler,
            request,
            wants_input.then_some(in_rx),
            &tx,
            thread_cancel,
        );
    });
    let guard = CancelOnDrop(cancel);
    let frames =
        futures_util::stream::unfold((rx, guard, false), |(mut rx, guard, done)| async move {
            if done {
                return None;
            }
            let next = tokio::time::timeout(wire::KEEPALIVE, rx.recv()).await;
            match next {
                Ok(Some(f)) => {
                    let last = matches!(f.first(), Some(&kind::REPLY) | Some(&kind::ERROR));
                    Some((Ok::<_, std::io::Error>(f), (rx, guard, last)))
                }
                Ok(None) => None,
                Err(_) => Some((
                    Ok(Bytes::from(wire::frame(kind::KEEPALIVE, b""))),
                    (rx, guard, false),
                )),
            }
        });
    let mut resp = Response::new(Body::from_stream(frames));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/x-ember-frames"),
    );
    resp
}

/// Runs the call on this thread, sending its frames to `tx`.
fn run(
    handler: &dyn Handler,
    request: Call,
    input: Option<mpsc::Receiver<std::io::Result<Bytes>>>,
    tx: &mpsc::Sender<Bytes>,
    cancel: Arc<Cancel>,
) {
    let send = |kind: u8, payload: &[u8]| {
        tx.blocking_send(Bytes::from(wire::frame(kind, payload)))
            .is_ok()
    };
    let mut on_event = |ev: &EventKind| match serde_json::to_vec(ev) {
        Ok(json) => send(kind::EVENT, &json),
        Err(_) => true,
    };
    let mut reader = input.map(ember_server::stream::ChannelReader::new);
    let mut out = FrameWriter { tx, gone: false };
    let mut io = Io::events(&mut on_event).with_cancel(cancel);
    if let Some(r) = reader.as_mut() {
        io.input = Some(r);
    }
    if matches!(request, Call::ReadFile(_) | Call::ReadArtifact(_)) {
        io.output = Some(&mut out);
    }
    let result = handler.handle(request, io);
    let (k, payload) = match result {
        Ok(reply) => match serde_json::to_vec(&reply) {
            Ok(json) => (kind::REPLY, json),
            Err(e) => (
                kind::ERROR,
                serde_json::to_vec(&WireError::of(&ember_runtime::RuntimeError::Internal(
                    format!("the reply cannot be encoded: {e}"),
                )))
                .unwrap_or_default(),
            ),
        },
        Err(e) => (
            kind::ERROR,
            serde_json::to_vec(&WireError::of(&e)).unwrap_or_default(),
        ),
    };
    send(k, &payload);
}

/// Output bytes as `D` frames (64 KiB at most each, as they are written).
struct FrameWriter<'a> {
    tx: &'a mpsc::Sender<Bytes>,
    gone: bool,
}

impl Write for FrameWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.gone {
            return Err(std::io::Error::new(
                std::io::ErrorKind::BrokenPipe,
                "the gateway went away",
            ));
        }
        let n = buf.len().min(64 << 10);
        if self
            .tx
            .blocking_send(Bytes::from(wire::frame(kind::DATA, &buf[..n])))
            .is_err()
        {
            self.gone = true;
            return Err(std::io::Error::new(
                std::io::ErrorKind::BrokenPipe,
                "the gateway went away",
            ));
        }
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// What the node registers with.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// Its id.
    pub id: String,
    /// Where gateways reach its internal API.
    pub advertise: String,
    /// Its labels.
    pub labels: serde_json::Value,
}

/// The node's own record, read off this host and runtime.
pub fn record(cfg: &NodeConfig, rt: &Runtime) -> NodeRecord {
    let (host_kind, cpu_profile) = crate::host::profile();
    NodeRecord {
        id: cfg.id.clone(),
        addr: cfg.advertise.clone(),
        version: env!("CARGO_PKG_VERSION").to_string(),
        host_kind,
        cpu_profile,
        max_running: i32::try_from(rt.config().max_running).unwrap_or(i32::MAX),
        running: running(rt),
        labels: cfg.labels.clone(),
        templates: templates(),
        max_memory_mib: i64::try_from(rt.config().max_committed_memory_mib).unwrap_or(i64::MAX),
        memory_mib: committed_mib(rt),
    }
}

/// Guest memory the running sandboxes have committed, MiB.
fn committed_mib(rt: &Runtime) -> i64 {
    live(rt)
        .map(|l| {
            l.iter()
                .filter(|s| s.state != ember_runtime::State::Paused)
                .map(|s| s.resources.memory_mib as i64)
                .sum()
        })
        .unwrap_or(0)
}

fn running(rt: &Runtime) -> i32 {
    live(rt)
        .map(|l| {
            l.iter()
                .filter(|s| s.state != ember_runtime::State::Paused)
                .count() as i32
        })
        .unwrap_or(0)
}

/// The sandboxes of this node that have not ended (running, paused, in between).
fn live(rt: &Runtime) -> Result<Vec<ember_runtime::SandboxInfo>, ember_runtime::RuntimeError> {
    let filter = ember_runtime::ListFilter::default();
    Ok(rt
        .list(&filter)?
        .into_iter()
        .filter(|s| !s.state.is_final())
        .collect())
}

fn templates() -> Vec<String> {
    ember_runtime::Template::list()
        .map(|l| l.into_iter().filter_map(|(name, _)| name).collect())
        .unwrap_or_default()
}

/// One step of a drain: every running sandbox is paused (its hooks record and upload the
/// pause; the gateways then continue it on another node at its next call).
fn drain_step(rt: &Runtime) {
    let Ok(list) = live(rt) else { return };
    for s in list
        .iter()
        .filter(|s| s.state == ember_runtime::State::Running)
    {
        match rt.pause(&s.id) {
            Ok(_) => tracing::info!("drain: sandbox {} paused", s.id),
            Err(e) => tracing::warn!("drain: sandbox {} not paused: {e}", s.id),
        }
    }
}

/// Drains node `node`: marks it draining in the directory (its heartbeat then pauses what
/// it runs, each pause is uploaded, and gateways continue each sandbox on another node at
/// its next call) and waits, up to `timeout`, until every sandbox of it can continue
/// elsewhere; `progress` hears how many are left each time that changes. Answers how long
/// it took.
pub fn drain(
    db: &Db,
    node: &str,
    timeout: Duration,
    mut progress: impl FnMut(i64),
) -> Result<Duration, FleetError> {
    if !db.set_draining(node)? {
        return Err(FleetError::Missing(format!(
            "node {node} is not registered"
        )));
    }
    let t0 = Instant::now();
    let mut last = -1;
    loop {
        match db.unmovable(node) {
            Ok(0) => return Ok(t0.elapsed()),
            Ok(n) if n != last => {
                progress(n);
                last = n;
            }
            Ok(_) => {}
            Err(e) => tracing::warn!("drain: {e} (retrying)"),
        }
        if t0.elapsed() > timeout {
            return Err(FleetError::Io(format!(
                "node {node}: not drained after {} s ({last} sandbox(es) left)",
                timeout.as_secs()
            )));
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Registers the node and heartbeats every [`HEARTBEAT`] on a thread of its own until
/// `stop` is set. A heartbeat that fails (the database is away) is retried at the next tick;
/// a node the directory forgot, or declared lost, drops what the directory gave away and
/// registers again (a new epoch). What the directory does not know at all is killed: at
/// once at the first beat (a node that starts again), after [`UNKNOWN_GRACE`] later (a
/// create whose gateway died before recording it).
pub fn start_heartbeat(
    db: Arc<Db>,
    cfg: NodeConfig,
    rt: Runtime,
    stop: Arc<AtomicBool>,
    hooks: Option<Arc<NodeHooks>>,
    live: Arc<Liveness>,
) -> Result<i64, FleetError> {
    let epoch = db.register(&record(&cfg, &rt))?;
    live.db_reached();
    // The audit log is shipped to the directory each beat, from where the last beat left it.
    let mut shipped = db.last_audit_seq(&cfg.id)?;
    let mut shipped_changes = db.last_transition_seq(&cfg.id)?;
    std::thread::Builder::new()
        .name("ember-heartbeat".into())
        .spawn(move || {
            let mut failing = false;
            let mut first = true;
            let mut unknown_since: HashMap<String, Instant> = HashMap::new();
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(HEARTBEAT);
                let filter = ember_runtime::AuditFilter {
                    after: Some(shipped),
                    limit: Some(5000),
                    ..Default::default()
                };
                if let Ok(changes) = rt.transitions_after(shipped_changes, 5000) {
                    if let Some(last) = changes.last().map(|c| c.0) {
                        match db.put_transitions(&cfg.id, &changes) {
                            Ok(()) => shipped_changes = last,
                            Err(e) => tracing::debug!("history not shipped (next beat): {e}"),
                        }
                    }
                }
                if let Ok(records) = rt.audit(&filter) {
                    if let Some(last) = records.last().map(|r| r.seq) {
                        match db.put_audit(&cfg.id, &records) {
                            Ok(()) => shipped = last,
                            Err(e) => tracing::debug!("audit not shipped (next beat): {e}"),
                        }
                    }
                }
                // Only with a complete list may the directory mark the others ended.
                let r = match live_ids(&rt) {
                    Ok(ids) => {
                        let running = running(&rt);
                        db.heartbeat(&cfg.id, running, committed_mib(&rt), &templates(), &ids)
                    }
                    Err(e) => Err(FleetError::Io(format!("listing the sandboxes: {e}"))),
                }
                .and_then(|hb| {
                    let importing = |id: &String| {
                        hooks.as_ref().is_some_and(|h| {
                            h.importing
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .contains(id)
                        })
                    };
                    // Sandboxes that continued on another node while this one was away, or
                    // were declared lost with it: a sandbox never answers from two VMs.
                    for id in hb.elsewhere.iter().filter(|id| !importing(id)) {
                        rt.forget(id, "the directory gives it to another node");
                    }
                    let now = Instant::now();
                    unknown_since.retain(|id, _| hb.unknown.contains(id));
                    for id in hb.unknown.iter().filter(|id| !importing(id)) {
                        let since = *unknown_since.entry(id.clone()).or_insert(now);
                        if first || now.duration_since(since) >= UNKNOWN_GRACE {
                            tracing::warn!(
                                "sandbox {id}: the directory does not know it{}: killed",
                                if first { " (found at start)" } else { "" }
                            );
                            if let Err(e) = rt.kill(id) {
                                tracing::warn!("sandbox {id}: not killed: {e}");
                            }
                            unknown_since.remove(id);
                        }
                    }
                    live.set_draining(hb.draining);
                    if hb.draining {
                        drain_step(&rt);
                    }
                    if !hb.known {
                        let epoch = db.register(&record(&cfg, &rt))?;
                        tracing::warn!(
                            "the directory had declared this node lost (or forgot it): what it \
                             gave away is dropped; registered again, epoch {epoch}"
                        );
                    }
                    first = false;
                    Ok(())
                });
                match (r, failing) {
                    (Ok(()), was) => {
                        // After what the directory said was acted on: a fence lifts only now.
                        live.db_reached();
                        if was {
                            tracing::info!("heartbeat: the directory answers again");
                            failing = false;
                        }
                    }
                    (Err(e), false) => {
                        tracing::warn!("heartbeat failed (retrying every second): {e}");
                        failing = true;
                    }
                    _ => {}
                }
            }
        })
        .map_err(|e| FleetError::Io(format!("cannot start the heartbeat thread: {e}")))?;
    Ok(epoch)
}

fn live_ids(rt: &Runtime) -> Result<Vec<String>, ember_runtime::RuntimeError> {
    Ok(live(rt)?.into_iter().map(|s| s.id).collect())
}

/// Starts the node's fence (a thread): once the node has reached neither the directory nor
/// any gateway for [`FENCE_AFTER`], the vCPUs of its running VMs are stopped and calls
/// refused, until a heartbeat gets through (and what the directory gave away meanwhile is
/// killed); then the VMs still here run again. With `watchdog`, it also feeds the VMMs'
/// watchdogs of that timeout while the node is not fenced.
pub fn start_fence(
    rt: Runtime,
    live: Arc<Liveness>,
    watchdog: Option<Duration>,
    stop: Arc<AtomicBool>,
) -> Result<(), FleetError> {
    std::thread::Builder::new()
        .name("ember-fence".into())
        .spawn(move || {
            let tick = Duration::from_millis(100);
            let mut keepalive = watchdog.map(ember_runtime::KeepAlive::new);
            let mut frozen: Vec<String> = Vec::new();
            let mut last_beat = Instant::now();
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(tick);
                let silent = live.silent_for();
                if !live.fenced() && silent >= FENCE_AFTER {
                    live.fenced_at_ms.store(live.now_ms(), Ordering::SeqCst);
                    live.fenced.store(true, Ordering::SeqCst);
                    frozen = rt.freeze_vms();
                    tracing::error!(
                        "fenced: neither the directory nor any gateway reached for {:.1} s; {} \
                         VM(s) stopped, calls refused until the directory answers",
                        silent.as_secs_f64(),
                        frozen.len()
                    );
                } else if live.fenced()
                    && live.db_ms.load(Ordering::SeqCst) > live.fenced_at_ms.load(Ordering::SeqCst)
                {
                    rt.thaw_vms(&frozen);
                    live.fenced.store(false, Ordering::SeqCst);
                    tracing::warn!(
                        "fence lifted: the directory answers; the VMs still here run again"
                    );
                    frozen.clear();
                }
                if let (Some(k), Some(w)) = (keepalive.as_mut(), watchdog) {
                    if !live.fenced() && silent < FENCE_AFTER && last_beat.elapsed() >= w / 4 {
                        k.beat(&rt);
                        last_beat = Instant::now();
                    }
                }
            }
        })
        .map(drop)
        .map_err(|e| FleetError::Io(format!("cannot start the fence thread: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silence_counts_from_the_later_of_the_directory_and_a_gateway() {
        let live = Liveness::default();
        std::thread::sleep(Duration::from_millis(30));
        assert!(live.silent_for() >= Duration::from_millis(30));
        live.gateway_reached();
        assert!(live.silent_for() < Duration::from_millis(30));
        std::thread::sleep(Duration::from_millis(30));
        live.db_reached();
        assert!(live.silent_for() < Duration::from_millis(30));
        assert!(!live.fenced() && !live.draining());
        live.set_draining(true);
        assert!(live.draining());
    }

    #[test]
    fn ping_round_trips_through_json() {
        let p = Ping {
            node: "n1".into(),
            fenced: true,
            draining: false,
        };
        let back: Ping = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
        assert_eq!(back, p);
    }
}
