//! E2B's REST control plane (`docs/e2b.md` §2, §8): sandboxes (`/v2/sandboxes`,
//! `/sandboxes/...`), snapshots (`/snapshots`, `DELETE /templates/{id}`), each a
//! translation to one or two runtime calls on a blocking thread.
//!
//! Status codes are the SDKs' contract: 201 on create, fork, snapshot and resume; 200 or 201
//! (resumed) on connect; 204 on kill, timeout, refresh and pause; 409 on pausing a paused
//! sandbox; 404 for a sandbox that does not exist or has ended (E2B forgets killed
//! sandboxes). Every error is `{"code": <status>, "message": "…"}`.

use ember_runtime::call::{self, Io};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, SystemTime};

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use base64::Engine;
use serde::Deserialize;
use serde_json::{json, Value};
use tower::ServiceExt;

use super::{E2bError, E2bJson, E2bPath, E2bQuery, E2bState, ENVD_VERSION};
use ember_runtime::{
    CreateRequest, ForkRequest, ListFilter, OnTimeout, RuntimeError, SandboxInfo, SnapshotInfo,
    SnapshotRequest, State as SandboxState,
};

/// The `clientID` of every sandbox (E2B's names the orchestrator node).
pub const CLIENT_ID: &str = "ember";

/// Default and largest page of a list.
const DEFAULT_LIMIT: usize = 100;
const MAX_LIMIT: usize = 1000;

type Answer<T> = Result<T, E2bError>;

/// Serves one control-plane request with `router` (the surface's, built once): `X-API-KEY`
/// must be the server's token.
pub async fn handle(st: &E2bState, router: &Router, req: Request) -> Response {
    if !api_key_ok(st, req.headers())
        && !super::volumes::content_token_ok(st, req.uri().path(), bearer(req.headers()))
        && !super::templates::upload_token_ok(st, req.method(), req.uri())
    {
        return E2bError::unauthorized(
            "missing or wrong X-API-KEY (set E2B_API_KEY to the server's token, from \
             $EMBER_HOME/token)",
        )
        .into_response();
    }
    match router.clone().oneshot(req).await {
        Ok(resp) => resp,
        Err(never) => match never {},
    }
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = v.trim().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

fn api_key_ok(st: &E2bState, headers: &HeaderMap) -> bool {
    let key = headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .or_else(|| {
            let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
            let (scheme, token) = v.trim().split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
        });
    key.is_some_and(|k| st.is_api_key(k))
}

pub(super) fn routes() -> Router<E2bState> {
    let routes = Router::new()
        .route("/v2/sandboxes", post(create).get(list_v2))
        .route("/sandboxes", post(create).get(list_v1))
        .route("/v2/sandboxes/{id}/connect", post(connect))
        .route("/sandboxes/{id}/connect", post(connect))
        .route("/sandboxes/{id}/resume", post(resume))
        .route("/sandboxes/{id}", get(detail).delete(kill))
        .route("/sandboxes/{id}/timeout", post(set_timeout))
        .route("/sandboxes/{id}/refreshes", post(refresh))
        .route("/sandboxes/{id}/pause", post(pause))
        .route("/sandboxes/{id}/metrics", get(metrics))
        .route("/sandboxes/{id}/fork", post(fork))
        .route("/sandboxes/{id}/snapshots", post(snapshot))
        .route("/snapshots", get(list_snapshots))
        .route("/templates", get(super::templates::list))
        .route("/v3/templates", post(super::templates::create))
        .route(
            "/templates/{id}/files/{hash}",
            get(super::templates::file_link).put(super::templates::upload),
        )
        .route(
            "/v2/templates/{id}/builds/{build}",
            post(super::templates::start),
        )
        .route(
            "/templates/{id}/builds/{build}/status",
            get(super::templates::status),
        )
        .route("/templates/aliases/{alias}", get(super::templates::alias))
        .route(
            "/templates/tags",
            post(super::templates::add_tags).delete(super::templates::remove_tags),
        )
        .route("/templates/{id}/tags", get(super::templates::tags))
        .route("/templates/{id}", delete(delete_snapshot))
        .route(
            "/secrets",
            post(super::secrets::create).get(super::secrets::list),
        )
        .route(
            "/secrets/{id}",
            get(super::secrets::get)
                .post(super::secrets::update)
                .delete(super::secrets::delete),
        )
        .route(
            "/volumes",
            post(super::volumes::create).get(super::volumes::list),
        )
        .route(
            "/volumes/{id}",
            get(super::volumes::get).delete(super::volumes::delete),
        )
        .route(
            "/volumecontent/{id}/file",
            get(super::volumes::read_file).put(super::volumes::write_file),
        )
        .route(
            "/volumecontent/{id}/path",
            get(super::volumes::stat_path)
                .patch(super::volumes::patch_path)
                .delete(super::volumes::remove_path),
        )
        .route(
            "/volumecontent/{id}/dir",
            get(super::volumes::list_dir).post(super::volumes::make_dir),
        );
    super::with_fallbacks(routes, "ember's E2B API")
}

// ----- shapes -----

/// The E2B state of a live sandbox (None once it ended: not listed, "not found").
pub fn e2b_state(s: SandboxState) -> Option<&'static str> {
    match s {
        SandboxState::Creating | SandboxState::Running | SandboxState::Resuming => Some("running"),
        SandboxState::Pausing | SandboxState::Paused => Some("paused"),
        SandboxState::Stopped | SandboxState::Failed => None,
    }
}

/// The template (or snapshot) a sandbox came from, as E2B's `templateID`.
fn template_id(info: &SandboxInfo) -> String {
    info.template
        .clone()
        .or_else(|| info.snapshot.clone())
        .unwrap_or_else(|| "unknown".into())
}

/// The E2B name of a sandbox's template: the first alias that maps to it, else its name.
fn alias_of(st: &E2bState, info: &SandboxInfo) -> String {
    let t = template_id(info);
    st.opts
        .aliases
        .iter()
        .find(|(_, v)| **v == t)
        .map(|(k, _)| k.clone())
        .unwrap_or(t)
}

/// `Sandbox` (create, connect, fork).
pub fn sandbox_json(st: &E2bState, info: &SandboxInfo, alias: Option<&str>) -> Value {
    json!({
        "templateID": template_id(info),
        "sandboxID": info.id,
        "clientID": CLIENT_ID,
        "envdVersion": ENVD_VERSION,
        "alias": alias.map(str::to_string).unwrap_or_else(|| alias_of(st, info)),
        "envdAccessToken": st.envd_token(&info.id),
        "trafficAccessToken": st.traffic_token(&info.id),
        "domain": st.domain(),
    })
}

fn end_at(info: &SandboxInfo) -> String {
    info.ends_at
        .clone()
        .or_else(|| info.max_until.clone())
        .unwrap_or_else(|| info.created_at.clone())
}

/// `ListedSandbox` (list).
pub fn listed_json(st: &E2bState, info: &SandboxInfo) -> Value {
    json!({
        "templateID": template_id(info),
        "alias": alias_of(st, info),
        "sandboxID": info.id,
        "clientID": CLIENT_ID,
        "startedAt": info.created_at,
        "endAt": end_at(info),
        "cpuCount": info.resources.vcpus,
        "memoryMB": info.resources.memory_mib,
        "diskSizeMB": info.resources.disk_mib,
        "metadata": info.metadata,
        "state": e2b_state(info.state).unwrap_or("running"),
        "envdVersion": ENVD_VERSION,
    })
}

/// `SandboxDetail` (get).
pub fn detail_json(st: &E2bState, info: &SandboxInfo) -> Value {
    let mut v = listed_json(st, info);
    let state = e2b_state(info.state).unwrap_or("running");
    let extra = json!({
        "envdAccessToken": st.envd_token(&info.id),
        "domain": st.domain(),
        "allowInternetAccess": false,
        "network": e2b_network_json(&info.network.policy),
        "lifecycle": {
            // Any envd or interpreter call resumes a paused sandbox.
            "autoResume": true,
            "onTimeout": match info.on_timeout {
                OnTimeout::Kill => "kill",
                OnTimeout::Pause => "pause",
            },
        },
    });
    if let (Some(m), Value::Object(e)) = (v.as_object_mut(), extra) {
        m.extend(e);
        if state == "paused" {
            m.insert("pauseMode".into(), json!("full"));
        }
    }
    v
}

/// A policy as E2B's `SandboxNetworkConfig`: `allowOut`, `denyOut`, `rules` (header values
/// as given: placeholders, never secrets' values).
fn e2b_network_json(p: &ember_runtime::NetworkPolicy) -> Value {
    let mut v = json!({
        "allowOut": p.allow_cidrs.iter().chain(&p.allow_domains).collect::<Vec<_>>(),
        "denyOut": p.deny_cidrs,
    });
    if !p.rules.is_empty() {
        v["rules"] = json!(p.rules);
    }
    if let Some(e) = &p.egress_proxy {
        v["egressProxy"] = json!({ "address": e.address });
    }
    v
}

// ----- helpers -----

/// A live sandbox, or 404.
async fn live(st: &E2bState, id: &str) -> Answer<SandboxInfo> {
    let id2 = id.to_string();
    let info = st
        .app
        .call(move |b| {
            b.call(
                call::Get {
                    id: id2.to_string(),
                },
                Io::none(),
            )
        })
        .await?;
    if info.state.is_final() {
        return Err(gone(id));
    }
    Ok(info)
}

fn gone(id: &str) -> E2bError {
    E2bError::not_found(format!("sandbox {id} not found"))
}

/// Runs `f` on a blocking thread; runtime errors become E2B errors.
async fn call<T: Send + 'static>(
    st: &E2bState,
    f: impl FnOnce(&dyn crate::Backend) -> Result<T, RuntimeError> + Send + 'static,
) -> Answer<T> {
    let job = st.app.spawn(f);
    match job.await {
        Ok(r) => r.map_err(E2bError::from),
        Err(e) => Err(E2bError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("the call failed: {e}"),
        )),
    }
}

fn secs_left(info: &SandboxInfo) -> Option<u64> {
    let end = humantime::parse_rfc3339_weak(info.ends_at.as_deref()?).ok()?;
    Some(
        end.duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO)
            .as_secs(),
    )
}

/// Sets the timeout to `secs` from now unless it already ends later.
fn extend(
    b: &dyn crate::Backend,
    info: &SandboxInfo,
    secs: u64,
) -> Result<SandboxInfo, RuntimeError> {
    if secs_left(info).is_some_and(|left| left >= secs) {
        return Ok(info.clone());
    }
    b.call(
        call::SetTimeout {
            id: info.id.to_string(),
            secs,
            on_timeout: None,
        },
        Io::none(),
    )
}

fn created(v: Value) -> Response {
    (StatusCode::CREATED, Json(v)).into_response()
}

// ----- sandboxes -----

/// `NewSandbox` / `NewSandboxV2`: what ember uses of it. Unknown fields are ignored.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct NewSandbox {
    /// Template id or alias, or a snapshot id.
    #[serde(rename = "templateID")]
    pub template_id: Option<String>,
    /// Seconds.
    pub timeout: Option<u64>,
    /// Labels.
    pub metadata: Option<BTreeMap<String, String>>,
    /// Environment of code and commands.
    #[serde(rename = "envVars")]
    pub env_vars: Option<BTreeMap<String, String>>,
    /// Pause instead of kill at the timeout.
    #[serde(rename = "autoPause")]
    pub auto_pause: Option<bool>,
    /// Internet access: `egress` when the server honours it (`--e2b-allow-internet`).
    pub allow_internet_access: Option<bool>,
    /// Egress lists.
    pub network: Option<E2bNetwork>,
    /// Volumes to mount: `[{"name", "path"}]` (docs/volumes.md).
    #[serde(rename = "volumeMounts")]
    pub volume_mounts: Option<Vec<E2bVolumeMount>>,
}

/// `SandboxVolumeMount`.
#[derive(Debug, Deserialize)]
pub struct E2bVolumeMount {
    /// The volume's name (its E2B id).
    pub name: String,
    /// Where it appears in the guest.
    pub path: String,
}

/// `SandboxNetworkConfig`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct E2bNetwork {
    /// Allowed destinations: CIDRs or addresses (`allow_cidrs`) and host names
    /// (`allow_domains`).
    #[serde(rename = "allowOut")]
    pub allow_out: Option<Vec<String>>,
    /// Denied CIDRs (`0.0.0.0/0` with an allow list: only the allow list).
    #[serde(rename = "denyOut")]
    pub deny_out: Option<Vec<String>>,
    /// Per-host request rules (`{"host": [{"transform": {"headers": {...}}}]}`), header
    /// values with `${e2b.secrets.NAME}` placeholders: the egress proxy's rules. A host must
    /// also be in `allowOut` when that is given.
    pub rules: Option<BTreeMap<String, Vec<ember_runtime::netpolicy::policy::HostRule>>>,
    /// `{"address": "IPv4:PORT"}`: a SOCKS5 proxy for the sandbox's TCP (ember's
    /// `egress_proxy`; `username`, `password` and `tls` are refused).
    #[serde(rename = "egressProxy")]
    pub egress_proxy: Option<Value>,
    /// Whether the sandbox's URLs (`<port>-<id>.<domain>`) take traffic without its traffic
    /// access token (E2B's default when absent: true). Either way every guest port is
    /// reachable through the E2B route, as on E2B.
    #[serde(rename = "allowPublicTraffic")]
    pub allow_public_traffic: Option<bool>,
}

/// The `egressProxy` of a create, or why ember cannot honour it.
fn e2b_egress_proxy(v: &Value) -> Result<ember_runtime::netpolicy::policy::EgressProxy, String> {
    let obj = v
        .as_object()
        .ok_or("network.egressProxy: expected an object with an address")?;
    for k in obj.keys() {
        if k != "address" {
            return Err(format!(
                "network.egressProxy.{k}: not supported by ember (a SOCKS5 proxy without \
                 authentication or TLS, at an IPv4:PORT address)"
            ));
        }
    }
    let address = obj
        .get("address")
        .and_then(Value::as_str)
        .ok_or("network.egressProxy: no address")?;
    Ok(ember_runtime::netpolicy::policy::EgressProxy {
        address: address.to_string(),
    })
}

/// ember's policy for an E2B create request.
pub fn e2b_policy(body: &NewSandbox, honour_internet: bool) -> ember_runtime::NetworkPolicy {
    use ember_runtime::{NetMode, NetworkPolicy};
    let mut p = NetworkPolicy::default();
    if honour_internet && body.allow_internet_access == Some(true) {
        p.mode = NetMode::Egress;
    }
    if let Some(n) = &body.network {
        for a in n.allow_out.iter().flatten() {
            if ember_runtime::netpolicy::Cidr4::parse(a).is_ok() {
                p.allow_cidrs.push(a.clone());
            } else {
                p.allow_domains.push(a.clone());
            }
        }
        p.deny_cidrs.extend(n.deny_out.iter().flatten().cloned());
        for (host, rules) in n.rules.iter().flatten() {
            p.rules.insert(host.to_ascii_lowercase(), rules.clone());
        }
        p.egress_proxy = n
            .egress_proxy
            .as_ref()
            .and_then(|v| e2b_egress_proxy(v).ok());
        if !p.allow_cidrs.is_empty() || !p.allow_domains.is_empty() || !p.deny_cidrs.is_empty() {
            p.mode = NetMode::Egress;
        }
    }
    p
}

/// The ember template an E2B template id names (aliases, then the id itself; a `:tag` is
/// dropped when only the bare name is known).
pub fn resolve_template(st: &E2bState, requested: &str) -> String {
    if let Some(t) = st.opts.aliases.get(requested) {
        return t.clone();
    }
    match requested.split_once(':') {
        Some((base, _)) => st
            .opts
            .aliases
            .get(base)
            .cloned()
            .unwrap_or_else(|| base.to_string()),
        None => requested.to_string(),
    }
}

async fn create(
    State(st): State<E2bState>,
    E2bJson(body): E2bJson<NewSandbox>,
) -> Answer<Response> {
    let requested = body.template_id.clone().unwrap_or_else(|| "base".into());
    let template = resolve_template(&st, &requested);
    if let Some(v) = body.network.as_ref().and_then(|n| n.egress_proxy.as_ref()) {
        e2b_egress_proxy(v).map_err(E2bError::invalid)?;
    }
    let req = CreateRequest {
        template: Some(template),
        timeout_secs: body.timeout,
        on_timeout: if body.auto_pause == Some(true) {
            OnTimeout::Pause
        } else {
            OnTimeout::Kill
        },
        network: e2b_policy(&body, st.opts.allow_internet),
        // E2B's rule for user ports: all reachable, public unless the create says not.
        expose_all_ports: Some(ember_runtime::AllPorts {
            public: body
                .network
                .as_ref()
                .and_then(|n| n.allow_public_traffic)
                .unwrap_or(true),
        }),
        env: body.env_vars.unwrap_or_default(),
        metadata: body.metadata.unwrap_or_default(),
        volume_mounts: body
            .volume_mounts
            .unwrap_or_default()
            .into_iter()
            .map(|m| ember_runtime::volumes::VolumeMount {
                name: m.name,
                path: m.path,
                read_only: false,
            })
            .collect(),
        ..Default::default()
    };
    // (A name that is no template but a named snapshot restores the snapshot: the runtime
    // resolves it, as E2B puts snapshot ids where template ids go.)
    let info = call(&st, move |b| b.call(call::Create { req }, Io::none())).await?;
    Ok(created(sandbox_json(&st, &info, Some(&requested))))
}

/// `ConnectSandbox(V2)` and `ResumedSandbox`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ConnectBody {
    timeout: Option<u64>,
    memory: Option<bool>,
}

async fn connect(
    State(st): State<E2bState>,
    E2bPath(id): E2bPath<String>,
    E2bJson(body): E2bJson<ConnectBody>,
) -> Answer<Response> {
    let info = live(&st, &id).await?;
    let paused = matches!(info.state, SandboxState::Paused | SandboxState::Pausing);
    // `memory: false` (`on_resume="reboot"`): the paused sandbox boots from its disk alone.
    let reboot = body.memory == Some(false);
    let info = call(&st, move |b| {
        if paused {
            let info = b.call(
                call::Resume {
                    id: info.id.to_string(),
                    reboot,
                },
                Io::none(),
            )?;
            match body.timeout {
                Some(t) => b.call(
                    call::SetTimeout {
                        id: info.id.to_string(),
                        secs: t,
                        on_timeout: None,
                    },
                    Io::none(),
                ),
                None => Ok(info),
            }
        } else {
            match body.timeout {
                Some(t) => extend(b, &info, t),
                None => Ok(info),
            }
        }
    })
    .await?;
    let status = if paused {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(sandbox_json(&st, &info, None))).into_response())
}

async fn resume(
    State(st): State<E2bState>,
    E2bPath(id): E2bPath<String>,
    E2bJson(body): E2bJson<ConnectBody>,
) -> Answer<Response> {
    let info = live(&st, &id).await?;
    if !matches!(info.state, SandboxState::Paused | SandboxState::Pausing) {
        return Err(E2bError::new(
            StatusCode::CONFLICT,
            format!("sandbox {id} is already running"),
        ));
    }
    let info = call(&st, move |b| {
        let info = b.call(
            call::Resume {
                id: id.to_string(),
                reboot: body.memory == Some(false),
            },
            Io::none(),
        )?;
        match body.timeout {
            Some(t) => b.call(
                call::SetTimeout {
                    id: id.to_string(),
                    secs: t,
                    on_timeout: None,
                },
                Io::none(),
            ),
            None => Ok(info),
        }
    })
    .await?;
    Ok(created(sandbox_json(&st, &info, None)))
}

async fn detail(State(st): State<E2bState>, E2bPath(id): E2bPath<String>) -> Answer<Json<Value>> {
    let info = live(&st, &id).await?;
    Ok(Json(detail_json(&st, &info)))
}

async fn kill(State(st): State<E2bState>, E2bPath(id): E2bPath<String>) -> Answer<StatusCode> {
    live(&st, &id).await?;
    call(&st, move |b| b.call(call::Kill { id }, Io::none())).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize)]
struct TimeoutBody {
    timeout: u64,
}

async fn set_timeout(
    State(st): State<E2bState>,
    E2bPath(id): E2bPath<String>,
    E2bJson(body): E2bJson<TimeoutBody>,
) -> Answer<StatusCode> {
    live(&st, &id).await?;
    call(&st, move |b| {
        b.call(
            call::SetTimeout {
                id: id.to_string(),
                secs: body.timeout,
                on_timeout: None,
            },
            Io::none(),
        )
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RefreshBody {
    duration: Option<u64>,
}

async fn refresh(
    State(st): State<E2bState>,
    E2bPath(id): E2bPath<String>,
    E2bJson(body): E2bJson<RefreshBody>,
) -> Answer<StatusCode> {
    let info = live(&st, &id).await?;
    if let Some(secs) = body.duration.filter(|s| *s > 0) {
        call(&st, move |b| extend(b, &info, secs)).await?;
    }
    Ok(StatusCode::NO_CONTENT)
}

async fn pause(State(st): State<E2bState>, E2bPath(id): E2bPath<String>) -> Answer<StatusCode> {
    // The body (`memory`, `requireHealthyGuest`) is accepted and not needed: a pause always
    // keeps memory (a filesystem-only pause is a superset's subset), and the guest is not
    // asked anything.
    let info = live(&st, &id).await?;
    if matches!(info.state, SandboxState::Paused | SandboxState::Pausing) {
        return Err(E2bError::new(
            StatusCode::CONFLICT,
            format!("sandbox {id} is already paused"),
        ));
    }
    // The runtime ends open attaches and watches first (the processes keep running and are
    // attachable after the resume; polling watchers watch again at their next poll).
    call(&st, move |b| {
        b.call(call::Pause { id: id.to_string() }, Io::none())
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn metrics(State(st): State<E2bState>, E2bPath(id): E2bPath<String>) -> Answer<Json<Value>> {
    let info = live(&st, &id).await?;
    if info.state != SandboxState::Running {
        return Ok(Json(json!([])));
    }
    let u = match call(&st, move |b| {
        b.call(call::GetUsage { id: id.to_string() }, Io::none())
    })
    .await
    {
        Ok(u) => u,
        // Paused or ended meanwhile: no samples.
        Err(e) if e.status == StatusCode::CONFLICT || e.status == StatusCode::NOT_FOUND => {
            return Ok(Json(json!([])))
        }
        Err(e) => return Err(e),
    };
    Ok(Json(json!([{
        "timestamp": ember_runtime::clock::rfc3339(u.at_ms),
        "timestampUnix": u.at_ms / 1000,
        "cpuCount": u.vcpus,
        "cpuUsedPct": u.cpu_used_pct,
        "memUsed": u.mem_used_bytes,
        "memCache": u.mem_cache_bytes,
        "memTotal": u.mem_total_bytes,
        "diskUsed": u.disk_used_bytes,
        "diskTotal": u.disk_total_bytes,
    }])))
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ForkBody {
    timeout: Option<u64>,
    count: Option<u32>,
}

async fn fork(
    State(st): State<E2bState>,
    E2bPath(id): E2bPath<String>,
    E2bJson(body): E2bJson<ForkBody>,
) -> Answer<Response> {
    live(&st, &id).await?;
    let req = ForkRequest {
        count: body.count.unwrap_or(1),
        timeout_secs: body.timeout,
        metadata: None,
    };
    let forks = call(&st, move |b| {
        b.call(
            call::Fork {
                id: id.to_string(),
                req: req.clone(),
            },
            Io::none(),
        )
    })
    .await?;
    let out: Vec<Value> = forks
        .iter()
        .map(|f| json!({"sandbox": sandbox_json(&st, f, None)}))
        .collect();
    Ok(created(Value::Array(out)))
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct SnapshotBody {
    name: Option<String>,
    memory: Option<bool>,
}

fn snapshot_json(s: &SnapshotInfo) -> Value {
    json!({"snapshotID": s.name, "names": [s.name]})
}

async fn snapshot(
    State(st): State<E2bState>,
    E2bPath(id): E2bPath<String>,
    E2bJson(body): E2bJson<SnapshotBody>,
) -> Answer<Response> {
    live(&st, &id).await?;
    // `memory: false` (`mode="filesystem"`): the disk alone; sandboxes created from it boot.
    let req = SnapshotRequest {
        name: body.name,
        memory: body.memory,
    };
    let s = call(&st, move |b| {
        b.call(
            call::TakeSnapshot {
                id: id.to_string(),
                req: req.clone(),
            },
            Io::none(),
        )
    })
    .await?;
    Ok(created(snapshot_json(&s)))
}

async fn delete_snapshot(
    State(st): State<E2bState>,
    E2bPath(id): E2bPath<String>,
) -> Answer<StatusCode> {
    // A template built through the template API goes as a template; any other id is a
    // snapshot (E2B's snapshots are templates too).
    if super::templates::is_built_here(&id) {
        return super::templates::delete(id).await;
    }
    call(&st, move |b| {
        b.call(
            call::DeleteSnapshot {
                name: id.to_string(),
            },
            Io::none(),
        )
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}

// ----- lists -----

/// `metadata=<urlencoded k=v&k2=v2>`: the SDKs percent-encode keys and values, then
/// url-encode the pairs (the query layer has undone the outer encoding).
pub fn parse_metadata(s: &str) -> BTreeMap<String, String> {
    s.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (
                percent_decode(&percent_decode(&k.replace('+', " "))),
                percent_decode(&percent_decode(&v.replace('+', " "))),
            )
        })
        .collect()
}

/// `%XX` decoding (invalid escapes are kept as they are; bytes that are not UTF-8 are
/// replaced).
pub fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A page of `items` (already sorted) after `token`, at most `limit`; the token of the
/// next page when more remain. A token is the base64 of the last item's sort key.
pub fn page<T>(
    items: Vec<T>,
    key: impl Fn(&T) -> String,
    token: Option<&str>,
    limit: usize,
    descending: bool,
) -> Answer<(Vec<T>, Option<String>)> {
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let after = match token.filter(|t| !t.is_empty()) {
        None => None,
        Some(t) => Some(
            b64.decode(t)
                .ok()
                .and_then(|b| String::from_utf8(b).ok())
                .ok_or_else(|| E2bError::invalid("nextToken: not a token this server made"))?,
        ),
    };
    let mut rest: Vec<T> = items
        .into_iter()
        .filter(|i| match &after {
            None => true,
            Some(a) if descending => key(i) < *a,
            Some(a) => key(i) > *a,
        })
        .collect();
    let next = (rest.len() > limit).then(|| b64.encode(key(&rest[limit - 1])));
    rest.truncate(limit);
    Ok((rest, next))
}

fn limit_of(v: Option<&String>) -> Answer<usize> {
    match v {
        None => Ok(DEFAULT_LIMIT),
        Some(s) => match s.parse::<usize>() {
            Ok(n) if (1..=MAX_LIMIT).contains(&n) => Ok(n),
            _ => Err(E2bError::invalid(format!(
                "limit={s:?}: expected 1 to {MAX_LIMIT}"
            ))),
        },
    }
}

fn with_next(v: Value, next: Option<String>) -> Response {
    let mut resp = Json(v).into_response();
    if let Some(t) = next.and_then(|t| HeaderValue::from_str(&t).ok()) {
        resp.headers_mut().insert("x-next-token", t);
    }
    resp
}

fn sort_key(info: &SandboxInfo) -> String {
    format!("{}|{}", info.created_at, info.id)
}

/// The live sandboxes matching the E2B list query.
async fn listed(
    st: &E2bState,
    q: &BTreeMap<String, String>,
    default_states: &[&str],
) -> Answer<Response> {
    let metadata = q
        .get("metadata")
        .map(|m| parse_metadata(m))
        .unwrap_or_default();
    let states: BTreeSet<String> = match q.get("state").filter(|s| !s.is_empty()) {
        Some(s) => s.split(',').map(|x| x.trim().to_string()).collect(),
        None => default_states.iter().map(|s| s.to_string()).collect(),
    };
    if let Some(bad) = states
        .iter()
        .find(|s| !["running", "paused"].contains(&s.as_str()))
    {
        return Err(E2bError::invalid(format!(
            "state={bad:?}: expected running or paused"
        )));
    }
    let descending = match q.get("order").map(String::as_str) {
        None | Some("desc") => true,
        Some("asc") => false,
        Some(o) => {
            return Err(E2bError::invalid(format!(
                "order={o:?}: expected asc or desc"
            )))
        }
    };
    let started_after = match q.get("startedAfter") {
        None => None,
        Some(s) => Some(humantime::parse_rfc3339_weak(s).map_err(|e| {
            E2bError::invalid(format!("startedAfter={s:?}: not an RFC 3339 time: {e}"))
        })?),
    };
    let template = q.get("template").map(|t| resolve_template(st, t));
    let limit = limit_of(q.get("limit"))?;
    let filter = ListFilter {
        metadata,
        ..ListFilter::default()
    };
    let mut all = call(st, move |b| {
        b.call(
            call::List {
                filter: filter.clone(),
            },
            Io::none(),
        )
    })
    .await?;
    all.retain(|i| {
        e2b_state(i.state).is_some_and(|s| states.contains(s))
            && template.as_ref().is_none_or(|t| template_id(i) == *t)
            && started_after.is_none_or(|after| {
                humantime::parse_rfc3339_weak(&i.created_at).is_ok_and(|c| c >= after)
            })
    });
    all.sort_by_key(sort_key);
    if descending {
        all.reverse();
    }
    let (items, next) = page(
        all,
        sort_key,
        q.get("nextToken").map(String::as_str),
        limit,
        descending,
    )?;
    let v: Vec<Value> = items.iter().map(|i| listed_json(st, i)).collect();
    Ok(with_next(Value::Array(v), next))
}

async fn list_v2(
    State(st): State<E2bState>,
    E2bQuery(q): E2bQuery<BTreeMap<String, String>>,
) -> Answer<Response> {
    listed(&st, &q, &["running", "paused"]).await
}

async fn list_v1(
    State(st): State<E2bState>,
    E2bQuery(q): E2bQuery<BTreeMap<String, String>>,
) -> Answer<Response> {
    listed(&st, &q, &["running"]).await
}

async fn list_snapshots(
    State(st): State<E2bState>,
    E2bQuery(q): E2bQuery<BTreeMap<String, String>>,
) -> Answer<Response> {
    let limit = limit_of(q.get("limit"))?;
    let mut all = call(&st, |b| b.call(call::ListSnapshots {}, Io::none())).await?;
    all.retain(|s| {
        q.get("sandboxID").is_none_or(|id| s.sandbox == *id)
            && q.get("name").is_none_or(|n| s.name == *n)
    });
    let key = |s: &SnapshotInfo| format!("{}|{}", s.created_at, s.name);
    all.sort_by_key(key);
    all.reverse();
    let (items, next) = page(
        all,
        key,
        q.get("nextToken").map(String::as_str),
        limit,
        true,
    )?;
    Ok(with_next(
        Value::Array(items.iter().map(snapshot_json).collect()),
        next,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ember_runtime::NetMode;

    #[test]
    fn e2b_network_options_map_to_a_policy() {
        let body: NewSandbox = serde_json::from_value(serde_json::json!({
            "templateID": "base", "allow_internet_access": true,
        }))
        .unwrap();
        assert_eq!(e2b_policy(&body, false).mode, NetMode::None);
        assert_eq!(e2b_policy(&body, true).mode, NetMode::Egress);
        let body: NewSandbox = serde_json::from_value(serde_json::json!({
            "network": {"allowOut": ["1.2.3.4", "10.1.0.0/16", "pypi.org"],
                        "denyOut": ["0.0.0.0/0"]},
        }))
        .unwrap();
        let p = e2b_policy(&body, false);
        assert_eq!(p.mode, NetMode::Egress);
        assert_eq!(p.allow_cidrs, ["1.2.3.4", "10.1.0.0/16"]);
        assert_eq!(p.allow_domains, ["pypi.org"]);
        assert_eq!(p.deny_cidrs, ["0.0.0.0/0"]);
        p.validate().unwrap();
    }

    #[test]
    fn e2b_rules_and_egress_proxy_map_and_show_as_placeholders() {
        let body: NewSandbox = serde_json::from_value(serde_json::json!({
            "network": {"allowOut": ["API.example.com"],
                        "rules": {"API.example.com": [{"transform": {"headers":
                            {"Authorization": "Bearer ${e2b.secrets.openai}"}}}]},
                        "egressProxy": {"address": "192.0.2.9:1080"}},
        }))
        .unwrap();
        let p = e2b_policy(&body, false);
        assert_eq!(p.mode, NetMode::Egress);
        assert!(p.rules.contains_key("api.example.com"));
        assert_eq!(p.egress_proxy.as_ref().unwrap().address, "192.0.2.9:1080");
        let shown = e2b_network_json(&p);
        assert_eq!(
            shown["rules"]["api.example.com"][0]["transform"]["headers"]["Authorization"],
            "Bearer ${e2b.secrets.openai}"
        );
        assert_eq!(shown["egressProxy"]["address"], "192.0.2.9:1080");
        let e =
            e2b_egress_proxy(&serde_json::json!({"address": "x:1", "password": "p"})).unwrap_err();
        assert!(e.contains("password"), "{e}");
    }
}
