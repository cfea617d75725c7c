//! `ember gateway`'s backend: the runtime's call surface for a whole fleet. The gateway runs
//! the same HTTP server as `ember serve` (native API, E2B API) over this [`Fleet`] instead of
//! a local runtime; each call goes to the node that holds its sandbox.
//!
//! - A call addressed to a sandbox (`Request::sandbox`) goes to its node: the route comes from
//!   a cache, else from the directory. A node that answers "no such sandbox" for a cached
//!   route has the route re-read once (it may have moved), never served by another VM.
//! - `create` is placed: nodes whose heartbeat is fresh ([`LIVE_WITHIN`]), with room, the
//!   fewest running first (ties: those that hold the template), those the gateway's own
//!   probe last failed to reach after the others; a node that refuses or cannot be reached
//!   is skipped for the next. A create from a named snapshot goes to the node that holds it.
//!   `fork` children are spread over the nodes.
//! - Every gateway probes every node each second ([`Fleet::start_sweeper`]): a node that
//!   answers is not declared lost however late its heartbeat, and each probe tells the node
//!   it is reached (a node reached by neither fences itself, `crate::node`).
//! - Lists (sandboxes, templates, snapshots) are asked of every live node and merged.
//!
//! The gateway keeps nothing that a restart would lose: routes are in the directory.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ember_runtime::call::{self, Handler, Io, Reply, Request};
use ember_runtime::{RuntimeError, SandboxInfo};

use crate::client::NodeClient;
use crate::db::{Db, NodeStatus};

/// The API key every client of a gateway is (one token per gateway fleet, for now): what
/// quotas are kept for.
pub const API_KEY: &str = "default";

/// A node is live when its last heartbeat is this recent.
pub const LIVE_WITHIN: Duration = Duration::from_secs(10);
/// A node silent this long is declared lost by the sweep (with what it ran).
pub const LOST_AFTER: Duration = Duration::from_secs(10);
/// A create's reservation this old is a gateway's that died mid-create: the sweep removes it.
pub const STALE_RESERVATION: Duration = Duration::from_secs(30);
/// How often a gateway sweeps.
const SWEEP_EVERY: Duration = Duration::from_secs(2);

/// The fleet, as a gateway sees it.
#[derive(Debug)]
pub struct Fleet {
    db: Arc<Db>,
    token: String,
    max_upload_bytes: u64,
    routes: Mutex<HashMap<String, String>>,
    clients: Mutex<HashMap<String, (String, Arc<NodeClient>)>>,
    /// The nodes as last read (at most [`NODES_FRESH`] old): whether a route's node is up.
    nodes: Mutex<Option<(std::time::Instant, Vec<NodeStatus>)>>,
    /// The blob store (artifacts of sandboxes whose node is gone).
    blobs: Option<Arc<crate::blobs::Blobs>>,
    /// The probe's findings per node: when it last answered, when it last failed to.
    probes: Mutex<HashMap<String, Probe>>,
}

/// What the gateway's probe last found of a node.
#[derive(Debug, Clone, Copy, Default)]
struct Probe {
    ok: Option<std::time::Instant>,
    failed: Option<std::time::Instant>,
}

impl Probe {
    /// The last probe failed.
    fn failing(&self) -> bool {
        match (self.ok, self.failed) {
            (_, None) => false,
            (None, Some(_)) => true,
            (Some(ok), Some(failed)) => failed > ok,
        }
    }
}

/// How often a gateway probes each node.
const PROBE_EVERY: Duration = Duration::from_secs(1);
/// A node the probe reached this recently is not declared lost.
const PROBED_WITHIN: Duration = Duration::from_secs(3);
/// How long a call waits for a sandbox that moves (a draining or fenced node's) before it
/// gives up.
const FOLLOW_FOR: Duration = Duration::from_secs(30);

/// What placement counts a node's lack of the template as: this many sandboxes of load.
const PULL_COST: i64 = 2;

/// How long the gateway trusts its last read of the nodes' liveness.
const NODES_FRESH: Duration = Duration::from_secs(1);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn db_error(e: crate::FleetError) -> RuntimeError {
    RuntimeError::Unavailable(format!("the fleet's directory: {e}; retry"))
}

impl Fleet {
    /// The fleet in `db`, reached with the node token.
    pub fn new(db: Arc<Db>, node_token: String, max_upload_bytes: u64) -> Fleet {
        Fleet {
            db,
            token: node_token,
            max_upload_bytes,
            routes: Mutex::new(HashMap::new()),
            clients: Mutex::new(HashMap::new()),
            nodes: Mutex::new(None),
            blobs: None,
            probes: Mutex::new(HashMap::new()),
        }
    }

    /// Starts this gateway's sweeper (a thread; every gateway runs one, the directory's lock
    /// lets one sweep at a time): nodes silent for [`LOST_AFTER`] are declared lost with what
    /// they ran, and reservations of creates a dead gateway left are removed.
    pub fn start_sweeper(self: &Arc<Self>) -> Result<(), crate::FleetError> {
        self.start_probe()?;
        let weak = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("ember-sweep".into())
            .spawn(move || {
                // Nodes are declared lost only once this gateway has reached the directory
                // for longer than LOST_AFTER: after an outage of the directory (when no node
                // could heartbeat), the nodes get their chance to beat first.
                let mut reachable_since: Option<std::time::Instant> = None;
                loop {
                    std::thread::sleep(SWEEP_EVERY);
                    let Some(fleet) = weak.upgrade() else { return };
                    let declare =
                        reachable_since.is_some_and(|t| t.elapsed() >= LOST_AFTER + SWEEP_EVERY);
                    let spare: Vec<String> = lock(&fleet.probes)
                        .iter()
                        .filter(|(_, p)| p.ok.is_some_and(|t| t.elapsed() < PROBED_WITHIN))
                        .map(|(n, _)| n.clone())
                        .collect();
                    let swept = fleet.db.sweep(
                        LOST_AFTER.as_secs_f64(),
                        STALE_RESERVATION.as_secs_f64(),
                        declare,
                        &spare,
                    );
                    reachable_since = match (&swept, reachable_since) {
                        (Ok(_), None) => Some(std::time::Instant::now()),
                        (Ok(_), since) => since,
                        (Err(_), _) => None,
                    };
                    match swept {
                        Ok((lost, gone)) => {
                            for n in &lost {
                                tracing::warn!(
                                    "node {n} declared lost: no heartbeat for {} s ({gone} \
                                 sandbox(es) lost with the nodes declared now)",
                                    LOST_AFTER.as_secs()
                                );
                            }
                            if !lost.is_empty() {
                                *lock(&fleet.nodes) = None;
                            }
                        }
                        Err(e) => tracing::debug!("sweep: {e}"),
                    }
                }
            })
            .map(drop)
            .map_err(|e| crate::FleetError::Io(format!("cannot start the sweeper: {e}")))
    }

    /// Starts the probe (a thread): every [`PROBE_EVERY`], each node that has not stopped
    /// is asked `GET /internal/v1/ping`, all at once, each within
    /// [`crate::client::PROBE_TIMEOUT`].
    fn start_probe(self: &Arc<Self>) -> Result<(), crate::FleetError> {
        let weak = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("ember-probe".into())
            .spawn(move || loop {
                std::thread::sleep(PROBE_EVERY);
                let Some(fleet) = weak.upgrade() else { return };
                let Ok(nodes) = fleet.nodes_cached() else {
                    continue;
                };
                let clients: Vec<Arc<NodeClient>> = nodes
                    .iter()
                    .filter(|n| n.status != "stopped")
                    .map(|n| fleet.client(n))
                    .collect();
                let found: Vec<(String, bool)> = std::thread::scope(|s| {
                    let probes: Vec<_> = clients
                        .iter()
                        .map(|c| s.spawn(move || (c.node.clone(), c.ping().is_ok())))
                        .collect();
                    probes.into_iter().filter_map(|p| p.join().ok()).collect()
                });
                let now = std::time::Instant::now();
                let mut probes = lock(&fleet.probes);
                for (node, ok) in found {
                    let p = probes.entry(node).or_default();
                    if ok {
                        p.ok = Some(now);
                    } else {
                        p.failed = Some(now);
                    }
                }
            })
            .map(drop)
            .map_err(|e| crate::FleetError::Io(format!("cannot start the probe: {e}")))
    }

    /// Whether the probe's last try of node `id` failed.
    fn probe_failing(&self, id: &str) -> bool {
        lock(&self.probes).get(id).is_some_and(Probe::failing)
    }

    /// Reads from the blob store what outlives a node (artifacts).
    pub fn with_blobs(mut self, blobs: Arc<crate::blobs::Blobs>) -> Fleet {
        self.blobs = Some(blobs);
        self
    }

    /// A sandbox's state history across the nodes it lived on: its node's own (up to the
    /// call) and what the others shipped; all of it from the directory when its node is down.
    fn history(&self, id: &str, req: Request, io: Io<'_>) -> Result<Reply, RuntimeError> {
        match self.to_sandbox(id, req, io) {
            Ok(Reply::History(mut own)) => {
                // The node that answered (the call followed the sandbox wherever it went).
                let node = self.route(id, false).ok();
                own.extend(self.db.history(id, node.as_deref()).map_err(db_error)?);
                own.sort_by(|a, b| a.at.cmp(&b.at));
                Ok(Reply::History(own))
            }
            Err(e @ (RuntimeError::NotFound(_) | RuntimeError::Unreachable(_))) => {
                let all = self.db.history(id, None).map_err(db_error)?;
                if all.is_empty() {
                    Err(e)
                } else {
                    Ok(Reply::History(all))
                }
            }
            other => other,
        }
    }

    /// Sandbox `id`'s artifacts as uploaded (the bundle of its last collection), when its
    /// node cannot say: `None` when none were uploaded.
    fn uploaded_artifacts(&self, id: &str) -> Result<Option<crate::blobs::Bundle>, RuntimeError> {
        let Some(blobs) = &self.blobs else {
            return Ok(None);
        };
        let Some(hash) = self.db.artifacts(id).map_err(db_error)? else {
            return Ok(None);
        };
        blobs
            .get_bundle(&hash)
            .map(Some)
            .map_err(|e| RuntimeError::Unreachable(e.to_string()))
    }

    /// `Artifacts` and `ReadArtifact`: from the sandbox's node, else (the node is down or
    /// gone, or forgot the sandbox) from the blob store.
    fn artifacts_call(
        &self,
        id: &str,
        req: Request,
        mut io: Io<'_>,
    ) -> Result<Reply, RuntimeError> {
        let first = self.to_sandbox(id, req.clone(), io.reborrow());
        let e = match first {
            Err(e @ (RuntimeError::NotFound(_) | RuntimeError::Unreachable(_))) => e,
            other => return other,
        };
        let Some(bundle) = self.uploaded_artifacts(id)? else {
            return Err(e);
        };
        let at = bundle.meta["collected_at"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        match req {
            Request::Artifacts(_) => Ok(Reply::Artifacts(
                bundle
                    .files
                    .iter()
                    .map(|f| ember_runtime::ArtifactInfo {
                        path: f.name.clone(),
                        size: f.len,
                        collected_at: at.clone(),
                    })
                    .collect(),
            )),
            Request::ReadArtifact(r) => {
                let f = bundle.file(&r.path).ok_or_else(|| {
                    RuntimeError::NoSuchArtifact(format!("no artifact {:?}", r.path))
                })?;
                let out = io.output.ok_or_else(|| {
                    RuntimeError::Internal("read_artifact without a place for the bytes".into())
                })?;
                let blobs = self
                    .blobs
                    .as_ref()
                    .ok_or_else(|| RuntimeError::Internal("no blob store".into()))?;
                blobs
                    .read_file(f, out)
                    .map(Reply::ReadArtifact)
                    .map_err(|e| RuntimeError::Unreachable(e.to_string()))
            }
            _ => Err(e),
        }
    }

    /// The live nodes (heartbeating, not stopped), fewest running first.
    pub fn live_nodes(&self) -> Result<Vec<NodeStatus>, RuntimeError> {
        let mut nodes: Vec<NodeStatus> = self
            .db
            .nodes()
            .map_err(db_error)?
            .into_iter()
            .filter(|n| n.heartbeat_age_secs <= LIVE_WITHIN.as_secs_f64() && n.status == "up")
            .collect();
        nodes.sort_by_key(|n| {
            (
                i64::from(n.node.running) + n.placed_recently,
                n.node.id.clone(),
            )
        });
        Ok(nodes)
    }

    fn client(&self, node: &NodeStatus) -> Arc<NodeClient> {
        let mut clients = lock(&self.clients);
        match clients.get(&node.node.id) {
            Some((addr, c)) if *addr == node.node.addr => c.clone(),
            _ => {
                let c = Arc::new(NodeClient::new(&node.node.id, &node.node.addr, &self.token));
                clients.insert(node.node.id.clone(), (node.node.addr.clone(), c.clone()));
                c
            }
        }
    }

    fn client_of(&self, node_id: &str) -> Result<Arc<NodeClient>, RuntimeError> {
        if let Some((_, c)) = lock(&self.clients).get(node_id) {
            return Ok(c.clone());
        }
        let nodes = self.db.nodes().map_err(db_error)?;
        let n = nodes
            .iter()
            .find(|n| n.node.id == node_id)
            .ok_or_else(|| RuntimeError::Internal(format!("node {node_id} is not registered")))?;
        Ok(self.client(n))
    }

    /// The node that holds `sandbox` (`fresh`: read past the cache).
    fn route(&self, sandbox: &str, fresh: bool) -> Result<String, RuntimeError> {
        if !fresh {
            if let Some(n) = lock(&self.routes).get(sandbox) {
                return Ok(n.clone());
            }
        }
        match self.db.route(sandbox).map_err(db_error)? {
            Some(n) => {
                lock(&self.routes).insert(sandbox.to_string(), n.clone());
                Ok(n)
            }
            None => Err(RuntimeError::NotFound(sandbox.to_string())),
        }
    }

    fn remember(&self, sandbox: &str, node: &str) -> Result<(), RuntimeError> {
        self.db.put_route(sandbox, node).map_err(db_error)?;
        lock(&self.routes).insert(sandbox.to_string(), node.to_string());
        Ok(())
    }

    /// The nodes, read at most [`NODES_FRESH`] ago.
    fn nodes_cached(&self) -> Result<Vec<NodeStatus>, RuntimeError> {
        let mut c = lock(&self.nodes);
        if let Some((at, n)) = &*c {
            if at.elapsed() < NODES_FRESH {
                return Ok(n.clone());
            }
        }
        let n = self.db.nodes().map_err(db_error)?;
        *c = Some((std::time::Instant::now(), n.clone()));
        Ok(n)
    }

    /// Whether node `id` takes calls: it heartbeats and has not said it stopped.
    fn node_up(&self, id: &str) -> bool {
        match self.nodes_cached() {
            Ok(nodes) => nodes.iter().any(|n| {
                n.node.id == id
                    && n.status == "up"
                    && n.heartbeat_age_secs <= LIVE_WITHIN.as_secs_f64()
            }),
            // The directory is away: try the node.
            Err(_) => true,
        }
    }

    /// Sandbox `id`'s node `from` is down: where the sandbox can go on. A paused sandbox
    /// whose snapshot is uploaded is taken in by another live node (the least loaded) and
    /// its route moves there; anything else is an error that says what became of it.
    fn relocate(&self, id: &str, from: &str) -> Result<String, RuntimeError> {
        let Some(s) = self.db.sandbox(id).map_err(db_error)? else {
            return Err(RuntimeError::NotFound(id.to_string()));
        };
        if s.ended && s.state == "lost" {
            return Err(RuntimeError::conflict(
                id,
                ember_runtime::State::Failed,
                format!(
                    "lost with its node {} (no heartbeat for {} s; it was running, or paused \
                     without an upload)",
                    s.node.as_deref().unwrap_or("?"),
                    LOST_AFTER.as_secs()
                ),
            ));
        }
        if s.ended {
            return Err(RuntimeError::NotFound(id.to_string()));
        }
        match s.node.as_deref() {
            Some(n) if n != from => {
                lock(&self.routes).insert(id.to_string(), n.to_string());
                return Ok(n.to_string());
            }
            _ => {}
        }
        let blob = match s.blob.clone().filter(|_| s.state == "paused") {
            Some(b) => b,
            None => {
                let draining = self.nodes_cached().is_ok_and(|n| {
                    n.iter()
                        .any(|n| n.node.id == from && n.status == "draining")
                });
                // Paused by a drain, its upload under way: the call waits for it and
                // follows the sandbox; a draining node still serves what it runs.
                let uploaded = (draining && s.state == "paused")
                    .then(|| self.await_upload(id))
                    .flatten();
                match uploaded {
                    Some(b) => b,
                    None if draining => return Ok(from.to_string()),
                    None => {
                        return Err(RuntimeError::Unreachable(if s.state == "paused" {
                            format!(
                                "sandbox {id} is paused on node {from}, which is down, and its snapshot was not uploaded yet: it can resume only there"
                            )
                        } else {
                            format!("sandbox {id} runs on node {from}, which is down")
                        }))
                    }
                }
            }
        };
        let req = crate::node::AdoptRequest {
            id: id.to_string(),
            from: from.to_string(),
            blob,
        };
        let mut last = None;
        // A snapshot restores only on a host of the same kind and CPU profile.
        let origin = self
            .nodes_cached()?
            .into_iter()
            .find(|n| n.node.id == from)
            .map(|n| (n.node.host_kind, n.node.cpu_profile));
        for n in self.live_nodes()?.iter().filter(|n| {
            n.node.id != from
                && n.status == "up"
                && origin
                    .as_ref()
                    .is_none_or(|(k, p)| *k == n.node.host_kind && *p == n.node.cpu_profile)
                && i64::from(n.node.running) + n.placed_recently < i64::from(n.node.max_running)
        }) {
            match self.client(n).adopt(&req) {
                Ok(r) => {
                    tracing::info!(
                        "sandbox {id}: moved from node {from} to node {} ({} KiB fetched, {:.0}                          ms)",
                        n.node.id,
                        r.moved.bytes_moved >> 10,
                        r.ms
                    );
                    lock(&self.routes).insert(id.to_string(), n.node.id.clone());
                    return Ok(n.node.id.clone());
                }
                Err(e) => {
                    tracing::warn!("sandbox {id}: node {} did not take it: {e}", n.node.id);
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or_else(|| {
            RuntimeError::Capacity(format!(
                "sandbox {id} is paused on node {from}, which is down, and no other live node has room for it"
            ))
        }))
    }

    /// A call to the node of its sandbox.
    fn to_sandbox(&self, id: &str, req: Request, io: Io<'_>) -> Result<Reply, RuntimeError> {
        let mut node = self.route(id, false)?;
        if !self.node_up(&node) {
            // Perhaps it moved (another gateway moved it): the directory says.
            node = self.route(id, true)?;
            if !self.node_up(&node) {
                node = self.relocate(id, &node)?;
            }
        }
        let fork = matches!(req, Request::Fork(_));
        let mut io = io;
        // A call may be sent twice unless it has input (the first attempt consumed it): a
        // node that answers "no such sandbox" (a stale route: it moved) or cannot be reached
        // has streamed nothing.
        let again = io.input.is_none().then(|| req.clone());
        let r = self.client_of(&node)?.handle(req, io.reborrow());
        let r = match (r, again) {
            (Err(RuntimeError::NotFound(_)), Some(req)) => {
                let fresh = self.route(id, true)?;
                if fresh == node {
                    return Err(RuntimeError::NotFound(id.to_string()));
                }
                self.client_of(&fresh)?.handle(req, io)
            }
            // The node drains (the sandbox is on its way elsewhere) or is fenced: the call
            // waits and follows the sandbox.
            (Err(e @ RuntimeError::Unavailable(_)), Some(req)) => self.follow(id, req, io, e),
            // The node is gone (it stopped since the liveness was read): read it again, and
            // a call that may be sent twice follows the sandbox wherever it can go on.
            (Err(e @ RuntimeError::Unreachable(_)), again) => {
                *lock(&self.nodes) = None;
                match again {
                    Some(req) if !self.node_up(&node) => {
                        let to = self.relocate(id, &node)?;
                        self.client_of(&to)?.handle(req, io)
                    }
                    _ => Err(e),
                }
            }
            (r, _) => r,
        };
        match &r {
            Ok(Reply::Fork(children)) if fork => {
                for c in children {
                    self.remember(&c.id, &node)?;
                }
                self.spread(&node, children);
            }
            // Its place in its key's quota is free at once (the node's heartbeat would say
            // so within a second anyway).
            Ok(Reply::Kill(info)) => {
                if let Err(e) = self.db.mark_ended(&info.id) {
                    tracing::warn!("kill: {} not marked ended: {e}", info.id);
                }
            }
            _ => {}
        }
        r
    }

    /// Sandbox `id`'s node answered "unavailable" (it drains and the sandbox moves off it,
    /// or it is fenced): the call follows the sandbox wherever the directory says it goes,
    /// for up to [`FOLLOW_FOR`].
    fn follow(
        &self,
        id: &str,
        req: Request,
        mut io: Io<'_>,
        first: RuntimeError,
    ) -> Result<Reply, RuntimeError> {
        let t0 = std::time::Instant::now();
        let mut last = first;
        while t0.elapsed() < FOLLOW_FOR {
            std::thread::sleep(Duration::from_millis(200));
            *lock(&self.nodes) = None;
            let mut node = self.route(id, true)?;
            if !self.node_up(&node) {
                node = self.relocate(id, &node)?;
            }
            match self.client_of(&node)?.handle(req.clone(), io.reborrow()) {
                Err(e @ RuntimeError::Unavailable(_)) => last = e,
                r => return r,
            }
        }
        Err(last)
    }

    /// A named snapshot: its name is reserved fleet-wide first (names are the fleet's, not a
    /// node's), then the sandbox's node takes it (and records and uploads it).
    fn take_snapshot(&self, mut t: call::TakeSnapshot, io: Io<'_>) -> Result<Reply, RuntimeError> {
        let name = t
            .req
            .name
            .clone()
            .unwrap_or_else(|| format!("{}-{}", t.id, ember_runtime::store::now_ms()));
        let node = self.route(&t.id, false)?;
        if !self.db.reserve_snapshot(&name, &node).map_err(db_error)? {
            return Err(RuntimeError::Invalid(format!(
                "a snapshot named {name:?} exists"
            )));
        }
        t.req.name = Some(name.clone());
        let id = t.id.clone();
        let r = self.to_sandbox(&id, t.into(), io);
        if r.is_err() {
            if let Err(e) = self.db.delete_snapshot(&name) {
                tracing::warn!("snapshot {name}: reservation not released: {e}");
            }
        }
        r
    }

    /// Spreads fork children over the fleet: the first stays with its parent, each other goes
    /// to another live node with room (least loaded first, round robin), the way any paused
    /// sandbox moves: paused on the parent's node, its upload awaited, taken in by the other
    /// node and resumed there. A child that cannot move stays (and runs) on its parent's node.
    fn spread(&self, parent_node: &str, children: &[SandboxInfo]) {
        if children.len() < 2 {
            return;
        }
        let Ok(nodes) = self.live_nodes() else { return };
        let Some(home) = self
            .nodes_cached()
            .ok()
            .and_then(|n| n.into_iter().find(|n| n.node.id == parent_node))
        else {
            return;
        };
        // A snapshot restores only where the host kind and CPU profile are the same.
        let targets: Vec<NodeStatus> = nodes
            .into_iter()
            .filter(|n| {
                n.node.id != parent_node
                    && n.node.host_kind == home.node.host_kind
                    && n.node.cpu_profile == home.node.cpu_profile
                    && i64::from(n.node.running) + n.placed_recently < i64::from(n.node.max_running)
            })
            .collect();
        if targets.is_empty() {
            return;
        }
        let Ok(parent) = self.client_of(parent_node) else {
            return;
        };
        let t0 = std::time::Instant::now();
        let moving: Vec<(&SandboxInfo, &NodeStatus)> =
            children[1..].iter().zip(targets.iter().cycle()).collect();
        let mut paused = Vec::new();
        for (c, to) in &moving {
            match parent.handle(call::Pause { id: c.id.clone() }.into(), Io::none()) {
                Ok(_) => paused.push((*c, *to)),
                Err(e) => tracing::warn!("fork: child {} stays on {parent_node}: {e}", c.id),
            }
        }
        for (c, to) in paused {
            let blob = self.await_upload(&c.id);
            let Some(blob) = blob else {
                tracing::warn!(
                    "fork: child {} stays on {parent_node}: its pause was not uploaded",
                    c.id
                );
                continue;
            };
            let req = crate::node::AdoptRequest {
                id: c.id.clone(),
                from: parent_node.to_string(),
                blob,
            };
            let client = self.client(to);
            let moved = client.adopt(&req).and_then(|_| {
                client.handle(
                    call::Resume {
                        id: c.id.clone(),
                        reboot: false,
                    }
                    .into(),
                    Io::none(),
                )
            });
            match moved {
                Ok(_) => {
                    lock(&self.routes).insert(c.id.clone(), to.node.id.clone());
                }
                Err(e) => tracing::warn!("fork: child {} not moved to {}: {e}", c.id, to.node.id),
            }
        }
        tracing::info!(
            "fork: {} children spread from {parent_node} in {:.0} ms",
            moving.len(),
            t0.elapsed().as_secs_f64() * 1e3
        );
    }

    /// Waits (up to 30 s) for the upload of sandbox `id`'s pause; its bundle.
    fn await_upload(&self, id: &str) -> Option<String> {
        let t0 = std::time::Instant::now();
        while t0.elapsed() < Duration::from_secs(30) {
            match self.db.sandbox(id) {
                Ok(Some(s)) if s.state == "paused" && s.blob.is_some() => return s.blob,
                Ok(Some(s)) if s.state == "paused" => {}
                Ok(_) => return None,
                Err(e) => tracing::debug!("waiting for the upload of {id}: {e}"),
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    /// Places a create on a live node, trying the next on refusal, within the API key's
    /// quota (a reservation in the directory first: gateways racing count each other).
    fn create(&self, req: call::Create, io: Io<'_>) -> Result<Reply, RuntimeError> {
        let _ = io;
        let resv = match self.db.reserve(API_KEY).map_err(db_error)? {
            Ok(r) => r,
            Err(why) => return Err(RuntimeError::Capacity(why)),
        };
        let r = self.place(req, &resv);
        if r.is_err() {
            if let Err(e) = self.db.release(&resv) {
                tracing::warn!("create: reservation {resv} not released: {e}");
            }
        }
        r
    }

    fn place(&self, req: call::Create, resv: &str) -> Result<Reply, RuntimeError> {
        let mut nodes = self.live_nodes()?;
        if nodes.is_empty() {
            return Err(RuntimeError::Capacity(
                "no node of the fleet is live (no heartbeat within 10 s)".into(),
            ));
        }
        // Nodes that hold what the sandbox starts from are preferred, by PULL_COST sandboxes'
        // worth of load: a cold node pulls it only when the warm ones are busier.
        let warm: Box<dyn Fn(&NodeStatus) -> bool> = match req.req.snapshot.clone() {
            Some(snap) => {
                nodes = self.holding_snapshot(&nodes, &snap)?;
                let origin = nodes[0].node.id.clone();
                Box::new(move |n| n.node.id == origin)
            }
            None => {
                let t = req.req.template.clone().unwrap_or_else(|| "default".into());
                Box::new(move |n| n.node.templates.contains(&t))
            }
        };
        nodes.sort_by_key(|n| {
            (
                self.probe_failing(&n.node.id),
                i64::from(n.node.running) + n.placed_recently + if warm(n) { 0 } else { PULL_COST },
                n.node.id.clone(),
            )
        });
        // Requested labels: only nodes that carry them all.
        let labels = &req.req.node_labels;
        if !labels.is_empty() {
            nodes.retain(|n| {
                labels
                    .iter()
                    .all(|(k, v)| n.node.labels.get(k).and_then(|x| x.as_str()) == Some(v))
            });
            if nodes.is_empty() {
                return Err(RuntimeError::Capacity(format!(
                    "no live node has the labels {}",
                    labels
                        .iter()
                        .map(|(k, v)| format!("{k}={v}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            }
        }
        // Room: its sandbox cap, and its memory when the request names a size (the node
        // checks both again, and a refusal moves on to the next).
        let want_mib = req.req.memory_mib.unwrap_or(0) as i64;
        let mut last = None;
        for n in nodes.iter().filter(|n| {
            i64::from(n.node.running) + n.placed_recently < i64::from(n.node.max_running)
                && (n.node.max_memory_mib == 0
                    || n.node.memory_mib + want_mib <= n.node.max_memory_mib)
        }) {
            let c = self.client(n);
            match c.handle(req.clone().into(), Io::none()) {
                Ok(Reply::Create(info)) => {
                    self.db
                        .confirm(resv, &info.id, &n.node.id)
                        .map_err(db_error)?;
                    lock(&self.routes).insert(info.id.clone(), n.node.id.clone());
                    return Ok(Reply::Create(info));
                }
                Ok(_) => {
                    return Err(RuntimeError::Internal(format!(
                        "node {} answered create with another call's reply",
                        n.node.id
                    )))
                }
                Err(e @ RuntimeError::Invalid(_)) => return Err(e),
                Err(e) => {
                    tracing::info!("create: node {} refused: {e}; trying the next", n.node.id);
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or_else(|| {
            RuntimeError::Capacity("every live node of the fleet is full".into())
        }))
    }

    /// Where a create from named snapshot `name` may go: the node that took it first, then,
    /// once it is uploaded, any other live node like it (which pulls it).
    fn holding_snapshot(
        &self,
        nodes: &[NodeStatus],
        name: &str,
    ) -> Result<Vec<NodeStatus>, RuntimeError> {
        let Some((origin, info, blob)) = self.db.snapshot(name).map_err(db_error)? else {
            return Err(RuntimeError::NoSuchSnapshot(format!(
                "no snapshot {name:?}"
            )));
        };
        if info.is_none() {
            return Err(RuntimeError::NoSuchSnapshot(format!(
                "snapshot {name:?} is still being taken"
            )));
        }
        let origin = origin.unwrap_or_default();
        let like = self
            .nodes_cached()?
            .into_iter()
            .find(|n| n.node.id == origin)
            .map(|n| (n.node.host_kind, n.node.cpu_profile));
        let mut out: Vec<NodeStatus> = nodes
            .iter()
            .filter(|n| n.node.id == origin)
            .cloned()
            .collect();
        if blob.is_some() {
            out.extend(
                nodes
                    .iter()
                    .filter(|n| {
                        n.node.id != origin
                            && like.as_ref().is_none_or(|(k, p)| {
                                *k == n.node.host_kind && *p == n.node.cpu_profile
                            })
                    })
                    .cloned(),
            );
        }
        if out.is_empty() {
            return Err(RuntimeError::NoSuchSnapshot(format!(
                "snapshot {name:?} is on node {origin}, which is down, and was not uploaded"
            )));
        }
        // The caller prefers the first: the origin when it is live.
        Ok(out)
    }

    /// Every live node's answer to `req` (nodes that fail are left out, with a log line).
    fn each(&self, req: &Request) -> Result<Vec<(String, Reply)>, RuntimeError> {
        let nodes = self.live_nodes()?;
        let mut out = Vec::new();
        for n in &nodes {
            match self.client(n).handle(req.clone(), Io::none()) {
                Ok(r) => out.push((n.node.id.clone(), r)),
                Err(e) => tracing::warn!("{}: node {} left out: {e}", req.name(), n.node.id),
            }
        }
        Ok(out)
    }

    fn list(&self, req: Request) -> Result<Reply, RuntimeError> {
        let mut all: Vec<SandboxInfo> = Vec::new();
        for (node, r) in self.each(&req)? {
            if let Reply::List(l) = r {
                for s in &l {
                    lock(&self.routes).insert(s.id.clone(), node.clone());
                }
                all.extend(l);
            }
        }
        all.sort_by(|a, b| a.created_at.cmp(&b.created_at).then(a.id.cmp(&b.id)));
        Ok(Reply::List(all))
    }
}

impl Handler for Fleet {
    fn handle(&self, req: Request, io: Io<'_>) -> Result<Reply, RuntimeError> {
        if let Request::TakeSnapshot(t) = req {
            return self.take_snapshot(t, io);
        }
        if let Request::History(call::History { id }) = &req {
            let id = id.clone();
            return self.history(&id, req, io);
        }
        if let Request::Artifacts(call::Artifacts { id })
        | Request::ReadArtifact(call::ReadArtifact { id, .. }) = &req
        {
            let id = id.clone();
            return self.artifacts_call(&id, req, io);
        }
        if let Some(id) = req.sandbox().map(str::to_string) {
            return self.to_sandbox(&id, req, io);
        }
        match req {
            Request::Create(c) => self.create(c, io),
            r @ Request::List(_) => self.list(r),
            r @ Request::ListTemplates(_) => {
                let mut all: Vec<ember_runtime::TemplateSummary> = Vec::new();
                for (_, reply) in self.each(&r)? {
                    if let Reply::ListTemplates(l) = reply {
                        for t in l {
                            if !all.iter().any(|x| x.name == t.name && x.key == t.key) {
                                all.push(t);
                            }
                        }
                    }
                }
                Ok(Reply::ListTemplates(all))
            }
            Request::ListSnapshots(_) => {
                let all = self
                    .db
                    .snapshots()
                    .map_err(db_error)?
                    .into_iter()
                    .filter_map(|v| serde_json::from_value(v).ok())
                    .collect();
                Ok(Reply::ListSnapshots(all))
            }
            Request::DeleteSnapshot(d) => {
                let r: Request = d.clone().into();
                // Every node's copy (the one that took it, those that pulled it), then the
                // fleet's record. (Its chunks stay in the blob store: no collection yet.)
                let mut deleted = false;
                for (_, reply) in self.each(&r)? {
                    deleted |= matches!(reply, Reply::DeleteSnapshot(()));
                }
                deleted |= self.db.delete_snapshot(&d.name).map_err(db_error)?;
                if deleted {
                    Ok(Reply::DeleteSnapshot(()))
                } else {
                    Err(RuntimeError::NoSuchSnapshot(format!(
                        "no live node holds snapshot {:?}",
                        d.name
                    )))
                }
            }
            Request::Audit(call::Audit { filter }) => {
                // The live nodes' own logs (up to the call), and what the others shipped to
                // the directory before they went away.
                let r: Request = call::Audit {
                    filter: filter.clone(),
                }
                .into();
                let mut all = Vec::new();
                let mut answered = Vec::new();
                for (node, reply) in self.each(&r)? {
                    if let Reply::Audit(l) = reply {
                        all.extend(l);
                        answered.push(node);
                    }
                }
                let others: Vec<String> = self
                    .nodes_cached()?
                    .into_iter()
                    .map(|n| n.node.id)
                    .filter(|n| !answered.contains(n))
                    .collect();
                if !others.is_empty() {
                    all.extend(self.db.audit(&others, &filter).map_err(db_error)?);
                }
                all.sort_by(|a: &ember_runtime::AuditRecord, b| a.at.cmp(&b.at));
                let limit = filter.limit.unwrap_or(1000).clamp(1, 100_000);
                if all.len() > limit {
                    all.drain(..all.len() - limit);
                }
                Ok(Reply::Audit(all))
            }
            r @ Request::GetMetrics(_) => {
                // The first live node's (a fleet-wide sum is the monitoring system's job).
                match self.each(&r)?.into_iter().next() {
                    Some((_, reply)) => Ok(reply),
                    None => Err(RuntimeError::Capacity(
                        "no node of the fleet is live".into(),
                    )),
                }
            }
            Request::BuildTemplate(b) => Err(RuntimeError::Invalid(format!(
                "template {}: templates are built on a node (`ember template build {}` there); \
                 the gateway lists them",
                b.name, b.name
            ))),
            other => Err(RuntimeError::Internal(format!(
                "the gateway cannot route {}",
                other.name()
            ))),
        }
    }
}

impl ember_server::Backend for Fleet {
    fn max_upload_bytes(&self) -> u64 {
        self.max_upload_bytes
    }

    /// A guest port of a sandbox anywhere in the fleet: a tunnel through its node's internal
    /// API (an HTTP upgrade), handed to the port and CDP proxies as if it were the port.
    fn connect_port(
        &self,
        id: &str,
        port: u16,
        require_exposed: bool,
    ) -> Result<std::net::TcpStream, RuntimeError> {
        let mut node = self.route(id, false)?;
        if !self.node_up(&node) {
            node = self.route(id, true)?;
            if !self.node_up(&node) {
                node = self.relocate(id, &node)?;
            }
        }
        let r = self.tunnel(&node, id, port, require_exposed);
        match r {
            // A stale route: the sandbox moved.
            Err(RuntimeError::NotFound(_)) => {
                let fresh = self.route(id, true)?;
                if fresh == node {
                    return r;
                }
                self.tunnel(&fresh, id, port, require_exposed)
            }
            r => r,
        }
    }
}

impl Fleet {
    /// Opens the data-plane tunnel to `id`'s `port` through node `node`.
    fn tunnel(
        &self,
        node: &str,
        id: &str,
        port: u16,
        require_exposed: bool,
    ) -> Result<std::net::TcpStream, RuntimeError> {
        use std::io::{Read, Write};
        let addr = self
            .nodes_cached()?
            .into_iter()
            .find(|n| n.node.id == node)
            .map(|n| n.node.addr)
            .ok_or_else(|| RuntimeError::Unreachable(format!("node {node} is not registered")))?;
        let lost = |what: String| RuntimeError::Unreachable(format!("node {node}: {what}"));
        let sa = std::net::ToSocketAddrs::to_socket_addrs(&addr)
            .map_err(|e| lost(format!("{addr}: {e}")))?
            .next()
            .ok_or_else(|| lost(format!("{addr}: no address")))?;
        let mut s = std::net::TcpStream::connect_timeout(&sa, Duration::from_secs(3))
            .map_err(|e| lost(format!("{addr}: {e}")))?;
        let _ = s.set_nodelay(true);
        // The node may resume the sandbox first: allow for it.
        let _ = s.set_read_timeout(Some(Duration::from_secs(60)));
        let head = format!(
            "GET /internal/v1/tunnel/{id}/{port}?exposed={} HTTP/1.1\r\nHost: {addr}\r\n\
             Authorization: Bearer {}\r\nConnection: Upgrade\r\nUpgrade: {}\r\n\r\n",
            u8::from(require_exposed),
            self.token,
            crate::node::TUNNEL_PROTOCOL
        );
        s.write_all(head.as_bytes())
            .map_err(|e| lost(format!("sending the tunnel request: {e}")))?;
        // The answer's head, a byte at a time: nothing of the guest's may be read past it.
        let mut resp = Vec::new();
        let mut b = [0u8; 1];
        while !resp.ends_with(b"\r\n\r\n") {
            if resp.len() > 16 << 10 {
                return Err(lost("the tunnel's answer is too long".into()));
            }
            match s.read(&mut b) {
                Ok(1) => resp.push(b[0]),
                Ok(_) => return Err(lost("closed the tunnel before answering".into())),
                Err(e) => return Err(lost(format!("the tunnel's answer: {e}"))),
            }
        }
        let text = String::from_utf8_lossy(&resp).into_owned();
        let status: u16 = text
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        if status == 101 {
            // As the runtime's own connections: non-blocking, for the proxies' async I/O.
            s.set_read_timeout(None)
                .and_then(|()| s.set_nonblocking(true))
                .map_err(|e| lost(format!("the tunnel: {e}")))?;
            return Ok(s);
        }
        // A refusal: its body is the runtime's error.
        let len: usize = text
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.trim()
                    .eq_ignore_ascii_case("content-length")
                    .then(|| v.trim().parse().ok())?
            })
            .unwrap_or(0)
            .min(64 << 10);
        let mut body = vec![0u8; len];
        let _ = s.read_exact(&mut body);
        match serde_json::from_slice::<crate::wire::WireError>(&body) {
            Ok(w) => Err(w.into_runtime()),
            Err(_) => Err(lost(format!(
                "refused the tunnel: HTTP {status}: {}",
                String::from_utf8_lossy(&body)
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn a_probe_is_failing_only_when_its_last_try_failed() {
        let t = Instant::now();
        let later = t + Duration::from_millis(10);
        assert!(!Probe::default().failing());
        let ok = Probe {
            ok: Some(t),
            failed: None,
        };
        assert!(!ok.failing());
        let never = Probe {
            ok: None,
            failed: Some(t),
        };
        assert!(never.failing());
        let went = Probe {
            ok: Some(t),
            failed: Some(later),
        };
        assert!(went.failing());
        let back = Probe {
            ok: Some(later),
            failed: Some(t),
        };
        assert!(!back.failing());
    }
}
