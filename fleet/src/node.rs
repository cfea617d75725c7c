//! `ember node`'s side of the fleet: the internal API that takes the runtime's calls from
//! gateways, and the registration and heartbeat that tell the directory the node is there.
//!
//! The internal API listens on its own address, apart from the node's own HTTP API, and
//! takes only the node token (`Authorization: Bearer <node token>`, compared in constant
//! time): it is never open. `POST /internal/v1/call` carries one call in the framing of
//! [`crate::wire`]; `GET /internal/v1/health` answers 200 while the runtime is up.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

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

/// What the internal API serves with.
#[derive(Clone)]
struct NodeState {
    handler: Arc<dyn Handler>,
    token: Arc<String>,
    mover: Option<Arc<Mover>>,
    ports: Option<Runtime>,
}

/// The internal API's router over `handler` (the node's runtime), guarded by `token`;
/// `mover`: what takes in sandboxes that move here (`POST /internal/v1/adopt`), when the
/// node has a blob store; `ports`: the runtime whose guests' ports the data-plane tunnel
/// reaches (`GET /internal/v1/tunnel/{id}/{port}`, an HTTP upgrade).
pub fn router(
    handler: Arc<dyn Handler>,
    token: String,
    mover: Option<Arc<Mover>>,
    ports: Option<Runtime>,
) -> Router {
    let st = NodeState {
        handler,
        token: Arc::new(token),
        mover,
        ports,
    };
    Router::new()
        .route("/internal/v1/call", post(call))
        .route("/internal/v1/adopt", post(adopt))
        .route("/internal/v1/tunnel/{id}/{port}", get(tunnel))
        // Every route above takes the node token; the health check below does not.
        .route_layer(axum::middleware::from_fn_with_state(
            st.clone(),
            require_token,
        ))
        .route("/internal/v1/health", get(|| async { StatusCode::OK }))
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
    next.run(req).await
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
}

impl NodeRuntime {
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

/// Registers the node and heartbeats every [`HEARTBEAT`] on a thread of its own until
/// `stop` is set. A heartbeat that fails (the database is away) is retried at the next tick;
/// a node the directory forgot registers again.
pub fn start_heartbeat(
    db: Arc<Db>,
    cfg: NodeConfig,
    rt: Runtime,
    stop: Arc<AtomicBool>,
    hooks: Option<Arc<NodeHooks>>,
) -> Result<i64, FleetError> {
    let epoch = db.register(&record(&cfg, &rt))?;
    // The audit log is shipped to the directory each beat, from where the last beat left it.
    let mut shipped = db.last_audit_seq(&cfg.id)?;
    let mut shipped_changes = db.last_transition_seq(&cfg.id)?;
    std::thread::Builder::new()
        .name("ember-heartbeat".into())
        .spawn(move || {
            let mut failing = false;
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
                let r = match live(&rt) {
                    Ok(l) => {
                        let ids: Vec<String> = l.into_iter().map(|s| s.id).collect();
                        let running = running(&rt);
                        db.heartbeat(&cfg.id, running, committed_mib(&rt), &templates(), &ids)
                    }
                    Err(e) => Err(FleetError::Io(format!("listing the sandboxes: {e}"))),
                }
                .and_then(|hb| {
                    // Sandboxes that continued on another node while this one was away.
                    for id in &hb.elsewhere {
                        let importing = hooks.as_ref().is_some_and(|h| {
                            h.importing
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .contains(id)
                        });
                        if !importing {
                            rt.forget(id, "the directory gives it to another node");
                        }
                    }
                    if hb.draining {
                        drain_step(&rt);
                    }
                    if hb.known {
                        Ok(())
                    } else {
                        db.register(&record(&cfg, &rt)).map(drop)
                    }
                });
                match (r, failing) {
                    (Ok(()), true) => {
                        tracing::info!("heartbeat: the directory answers again");
                        failing = false;
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
