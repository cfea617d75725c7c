//! The HTTP layer against a fake backend: routes vs the OpenAPI document, auth, errors,
//! streams (and their cancellation when the client goes away), uploads and downloads.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use ember_runtime::call::{
    ContextInfo, DirEntry, EndStatus, ErrorCode, EventKind, ExecRequest, ExitStatus, FileStat,
    RunCodeRequest,
};
use serde_json::{json, Value};
use tower::ServiceExt;

use super::types::{TemplateSummary, VmShapeInfo};
use super::{
    error, load_or_create_token, openapi, route_list, router, routes, AppState, Backend,
    ServeOptions, Server,
};
use axum::Router;
use ember_runtime::template::{BuildEvent, TemplateError};
use ember_runtime::{
    ArtifactInfo, AuditFilter, AuditRecord, CreateRequest, ForkRequest, ListFilter, Metrics,
    OnTimeout, Resources, SandboxInfo, SnapshotInfo, SnapshotRequest, State, Transition,
};
use ember_runtime::{RunEnd, RuntimeError};

pub(crate) const TOKEN: &str = "0123456789abcdef0123456789abcdef";
pub(crate) const KNOWN: &str = "aaaaaaaaaaaaaaaa";

/// A backend without VMs: sandbox [`KNOWN`] exists, every other id does not.
#[derive(Debug, Default)]
pub(crate) struct Fake {
    /// Where `connect_port` connects (the browser routes' tests); None: refused.
    pub(crate) guest: Mutex<Option<std::net::SocketAddr>>,
    pub(crate) cancelled: AtomicBool,
    pub(crate) events_sent: AtomicUsize,
    pub(crate) written: Mutex<Vec<u8>>,
    /// `interrupt` was called (with this context).
    pub(crate) interrupted: AtomicBool,
    /// A `run_code`'s cancel fired while it ran.
    pub(crate) run_cancelled: AtomicBool,
    pub(crate) interrupted_context: Mutex<Option<String>>,
}

fn info(id: &str) -> SandboxInfo {
    SandboxInfo {
        id: id.into(),
        template: Some("default".into()),
        snapshot: None,
        forked_from: None,
        state: State::Running,
        reason: None,
        created_at: "2026-01-01T00:00:00Z".into(),
        ends_at: None,
        max_until: None,
        on_timeout: OnTimeout::Kill,
        resources: Resources::default(),
        metadata: BTreeMap::new(),
        env: BTreeMap::new(),
        pid: Some(42),
        start_ms: Some(12.5),
        network: Default::default(),
    }
}

fn known(id: &str) -> Result<(), RuntimeError> {
    if id == KNOWN {
        Ok(())
    } else {
        Err(RuntimeError::NotFound(id.into()))
    }
}

fn stdout(s: &str) -> EventKind {
    EventKind::Stdout {
        data: s.as_bytes().to_vec(),
    }
}

impl Backend for Fake {
    fn connect_port(
        &self,
        id: &str,
        port: u16,
        _require_exposed: bool,
    ) -> Result<std::net::TcpStream, RuntimeError> {
        known(id)?;
        let addr = *self.guest.lock().unwrap();
        match addr {
            Some(a) => std::net::TcpStream::connect(a)
                .map_err(|e| RuntimeError::Unreachable(format!("{id} port {port}: {e}"))),
            None => Err(RuntimeError::Unreachable(format!(
                "{id} port {port}: connection refused"
            ))),
        }
    }
    fn max_upload_bytes(&self) -> u64 {
        1000
    }
}

impl Fake {
    pub(crate) fn templates(&self) -> Result<Vec<TemplateSummary>, RuntimeError> {
        Ok(vec![])
    }
    pub(crate) fn build_template(
        &self,
        name: &str,
        _rebuild: bool,
        progress: &mut dyn FnMut(BuildEvent),
    ) -> Result<TemplateSummary, RuntimeError> {
        ember_runtime::template::check_name(name)?;
        progress(BuildEvent::Step("guest kernel".into()));
        if name == "broken" {
            return Err(TemplateError::Warmup {
                name: name.into(),
                message: "boom".into(),
            }
            .into());
        }
        Ok(TemplateSummary {
            name: Some(name.into()),
            key: "k".into(),
            built_at: "now".into(),
            vm: VmShapeInfo {
                vcpus: 1,
                memory_mib: 512,
                disk_mib: None,
            },
            snapshot_bytes: 1,
            outputs: "/workspace/outputs".into(),
        })
    }
    pub(crate) fn create(&self, _req: &CreateRequest) -> Result<SandboxInfo, RuntimeError> {
        Ok(info(KNOWN))
    }
    pub(crate) fn list(&self, _f: &ListFilter) -> Result<Vec<SandboxInfo>, RuntimeError> {
        Ok(vec![info(KNOWN)])
    }
    pub(crate) fn get(&self, id: &str) -> Result<SandboxInfo, RuntimeError> {
        known(id).map(|_| info(id))
    }
    pub(crate) fn kill(&self, id: &str) -> Result<SandboxInfo, RuntimeError> {
        self.get(id)
    }
    pub(crate) fn pause(&self, id: &str) -> Result<SandboxInfo, RuntimeError> {
        known(id)?;
        Err(RuntimeError::Conflict {
            id: id.into(),
            state: "stopped",
            message: "it has ended".into(),
        })
    }
    pub(crate) fn resume(&self, id: &str) -> Result<SandboxInfo, RuntimeError> {
        self.get(id)
    }
    pub(crate) fn set_timeout(
        &self,
        id: &str,
        _secs: u64,
        _o: Option<OnTimeout>,
    ) -> Result<SandboxInfo, RuntimeError> {
        self.get(id)
    }
    pub(crate) fn snapshot(
        &self,
        id: &str,
        r: &SnapshotRequest,
    ) -> Result<SnapshotInfo, RuntimeError> {
        known(id)?;
        // Tells the callers' tests which kind of snapshot reached the runtime.
        if r.memory == Some(false) {
            return Err(RuntimeError::Invalid(
                "fake: a filesystem-only snapshot".into(),
            ));
        }
        Err(RuntimeError::Capacity("full".into()))
    }
    pub(crate) fn snapshots(&self) -> Result<Vec<SnapshotInfo>, RuntimeError> {
        Ok(vec![])
    }
    pub(crate) fn delete_snapshot(&self, name: &str) -> Result<(), RuntimeError> {
        Err(RuntimeError::NoSuchSnapshot(format!(
            "no snapshot {name:?}"
        )))
    }
    pub(crate) fn fork(
        &self,
        id: &str,
        _r: &ForkRequest,
    ) -> Result<Vec<SandboxInfo>, RuntimeError> {
        self.get(id).map(|i| vec![i])
    }
    pub(crate) fn history(&self, id: &str) -> Result<Vec<Transition>, RuntimeError> {
        known(id).map(|_| vec![])
    }
    pub(crate) fn audit(&self, _f: &AuditFilter) -> Result<Vec<AuditRecord>, RuntimeError> {
        Ok(vec![])
    }
    pub(crate) fn metrics(&self) -> Metrics {
        Metrics::default()
    }
    pub(crate) fn context_create(
        &self,
        id: &str,
        language: &str,
        cwd: Option<&str>,
    ) -> Result<ContextInfo, RuntimeError> {
        known(id)?;
        Ok(ContextInfo {
            id: "c1".into(),
            language: language.into(),
            cwd: cwd.unwrap_or("/").into(),
            pid: 7,
            busy: None,
        })
    }
    pub(crate) fn context_list(&self, id: &str) -> Result<Vec<ContextInfo>, RuntimeError> {
        known(id).map(|_| vec![])
    }
    pub(crate) fn context_restart(&self, id: &str, _c: &str) -> Result<(), RuntimeError> {
        known(id)
    }
    pub(crate) fn context_remove(&self, id: &str, _c: &str) -> Result<(), RuntimeError> {
        known(id)
    }
    pub(crate) fn process_signal(
        &self,
        id: &str,
        _pid: i32,
        _signal: i32,
    ) -> Result<(), RuntimeError> {
        known(id)?;
        self.interrupted.store(true, Ordering::SeqCst);
        Ok(())
    }
    pub(crate) fn interrupt(&self, id: &str, c: &str) -> Result<(), RuntimeError> {
        known(id)?;
        *self.interrupted_context.lock().unwrap() = Some(c.to_string());
        self.interrupted.store(true, Ordering::SeqCst);
        Ok(())
    }
    pub(crate) fn run_code(
        &self,
        id: &str,
        req: &RunCodeRequest,
        on_event: &mut dyn FnMut(&EventKind) -> bool,
        cancel: Option<Arc<ember_runtime::call::Cancel>>,
    ) -> Result<RunEnd, RuntimeError> {
        known(id)?;
        if req.code == "forever" {
            // Like a guest printing in a loop: only a cancelled callback ends it.
            for i in 0.. {
                self.events_sent.store(i, Ordering::SeqCst);
                if !on_event(&stdout(&format!("line {i}\n"))) {
                    self.cancelled.store(true, Ordering::SeqCst);
                    return Err(RuntimeError::Invalid("run_code cancelled".into()));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        if req.code == "silent" {
            // Like `time.sleep(3600)`: no output until interrupted, or until the call is
            // cancelled (the runtime closes its agent connection: the agent interrupts that run).
            on_event(&stdout("start\n"));
            let t0 = std::time::Instant::now();
            while !self.interrupted.load(Ordering::SeqCst) {
                if cancel.as_ref().is_some_and(|c| c.fired()) {
                    self.run_cancelled.store(true, Ordering::SeqCst);
                    return Err(RuntimeError::Cancelled("run_code cancelled".into()));
                }
                if t0.elapsed() > Duration::from_secs(20) {
                    return Err(RuntimeError::Internal("never interrupted".into()));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            let ev = EventKind::Exception(ember_runtime::call::Exception {
                name: "KeyboardInterrupt".into(),
                value: String::new(),
                traceback: vec![],
            });
            if !on_event(&ev) {
                self.cancelled.store(true, Ordering::SeqCst);
            }
            return Ok(RunEnd {
                status: EndStatus::Interrupted,
                execution_count: Some(2),
                duration_ms: Some(1),
            });
        }
        if req.code == "fail" {
            on_event(&stdout("partial\n"));
            return Err(RuntimeError::Timeout {
                id: id.into(),
                message: "too slow".into(),
            });
        }
        on_event(&stdout("hi\n"));
        Ok(RunEnd {
            status: EndStatus::Ok,
            execution_count: Some(1),
            duration_ms: Some(3),
        })
    }
    pub(crate) fn exec(
        &self,
        id: &str,
        req: &ExecRequest,
        on_event: &mut dyn FnMut(&EventKind) -> bool,
    ) -> Result<EndStatus, RuntimeError> {
        known(id)?;
        on_event(&EventKind::Started { pid: 9 });
        on_event(&stdout(&req.argv.join(" ")));
        on_event(&EventKind::Exit(ExitStatus::Code(3)));
        Ok(EndStatus::Ok)
    }
    pub(crate) fn write_file(
        &self,
        id: &str,
        _p: &str,
        data: &mut dyn Read,
    ) -> Result<u64, RuntimeError> {
        known(id)?;
        let mut v = Vec::new();
        data.read_to_end(&mut v)
            .map_err(|e| RuntimeError::Internal(e.to_string()))?;
        let n = v.len() as u64;
        *self.written.lock().unwrap() = v;
        Ok(n)
    }
    pub(crate) fn read_file(
        &self,
        id: &str,
        path: &str,
        out: &mut dyn Write,
    ) -> Result<u64, RuntimeError> {
        known(id)?;
        if path != "/data" {
            return Err(RuntimeError::Guest {
                id: id.into(),
                call: "file_read",
                code: ErrorCode::NotFound,
                message: format!("no {path}"),
            });
        }
        let chunk = [b'x'; 1000];
        for _ in 0..300 {
            out.write_all(&chunk)
                .map_err(|e| RuntimeError::Internal(e.to_string()))?;
        }
        Ok(300_000)
    }
    pub(crate) fn list_files(
        &self,
        id: &str,
        _p: &str,
        _d: u32,
    ) -> Result<Vec<DirEntry>, RuntimeError> {
        known(id).map(|_| vec![])
    }
    pub(crate) fn stat(&self, id: &str, _p: &str) -> Result<FileStat, RuntimeError> {
        known(id)?;
        Err(RuntimeError::Internal("disk on fire".into()))
    }
    pub(crate) fn mkdir(&self, id: &str, _p: &str) -> Result<(), RuntimeError> {
        known(id)
    }
    pub(crate) fn remove(&self, id: &str, _p: &str, _r: bool) -> Result<(), RuntimeError> {
        known(id)
    }
    pub(crate) fn rename(&self, id: &str, _f: &str, _t: &str) -> Result<(), RuntimeError> {
        known(id)
    }
    pub(crate) fn collect_artifacts(&self, id: &str) -> Result<Vec<ArtifactInfo>, RuntimeError> {
        known(id).map(|_| vec![])
    }
    pub(crate) fn artifacts(&self, id: &str) -> Result<Vec<ArtifactInfo>, RuntimeError> {
        known(id).map(|_| vec![])
    }
    pub(crate) fn artifact_path(&self, id: &str, path: &str) -> Result<PathBuf, RuntimeError> {
        known(id)?;
        Err(RuntimeError::NoSuchArtifact(format!(
            "no artifact {path:?}"
        )))
    }
}

/// The fake behind the call surface: the same dispatch as the runtime's, to the methods above.
mod dispatch {
    use super::*;
    use ember_runtime::call::*;
    use ember_runtime::call::{Handler, Io, Reply, Request};

    impl Handler for Fake {
        fn handle(&self, req: Request, io: Io<'_>) -> Result<Reply, RuntimeError> {
            let Io {
                events,
                input,
                output,
                progress,
                cancel,
            } = io;
            let mut no_events = |_: &EventKind| true;
            let events: &mut dyn FnMut(&EventKind) -> bool = match events {
                Some(f) => f,
                None => &mut no_events,
            };
            let missing = |what: &str| RuntimeError::Internal(format!("the caller gave no {what}"));
            Ok(match req {
                Request::ListTemplates(ListTemplates {}) => Reply::ListTemplates(self.templates()?),
                Request::BuildTemplate(BuildTemplate { name, rebuild }) => {
                    let mut quiet = |_: BuildEvent| {};
                    let progress: &mut dyn FnMut(BuildEvent) = match progress {
                        Some(f) => f,
                        None => &mut quiet,
                    };
                    Reply::BuildTemplate(self.build_template(&name, rebuild, progress)?)
                }
                Request::Create(Create { req }) => Reply::Create(self.create(&req)?),
                Request::List(List { filter }) => Reply::List(self.list(&filter)?),
                Request::Get(Get { id }) => Reply::Get(self.get(&id)?),
                Request::Kill(Kill { id }) => Reply::Kill(self.kill(&id)?),
                Request::Pause(Pause { id }) => Reply::Pause(self.pause(&id)?),
                Request::Resume(Resume { id, .. }) => Reply::Resume(self.resume(&id)?),
                Request::SetTimeout(SetTimeout {
                    id,
                    secs,
                    on_timeout,
                }) => Reply::SetTimeout(self.set_timeout(&id, secs, on_timeout)?),
                Request::TakeSnapshot(TakeSnapshot { id, req }) => {
                    Reply::TakeSnapshot(self.snapshot(&id, &req)?)
                }
                Request::ListSnapshots(ListSnapshots {}) => Reply::ListSnapshots(self.snapshots()?),
                Request::DeleteSnapshot(DeleteSnapshot { name }) => {
                    Reply::DeleteSnapshot(self.delete_snapshot(&name)?)
                }
                Request::Fork(Fork { id, req }) => Reply::Fork(self.fork(&id, &req)?),
                Request::History(History { id }) => Reply::History(self.history(&id)?),
                Request::Audit(Audit { filter }) => Reply::Audit(self.audit(&filter)?),
                Request::GetMetrics(GetMetrics {}) => Reply::GetMetrics(self.metrics()),
                Request::ContextCreate(ContextCreate {
                    id, language, cwd, ..
                }) => Reply::ContextCreate(self.context_create(&id, &language, cwd.as_deref())?),
                Request::ContextList(ContextList { id }) => {
                    Reply::ContextList(self.context_list(&id)?)
                }
                Request::ContextRestart(ContextRestart { id, context }) => {
                    Reply::ContextRestart(self.context_restart(&id, &context)?)
                }
                Request::ContextRemove(ContextRemove { id, context }) => {
                    Reply::ContextRemove(self.context_remove(&id, &context)?)
                }
                Request::Interrupt(Interrupt { id, context }) => {
                    Reply::Interrupt(self.interrupt(&id, &context)?)
                }
                Request::ProcessSignal(ProcessSignal { id, pid, signal }) => {
                    Reply::ProcessSignal(self.process_signal(&id, pid, signal)?)
                }
                Request::RunCode(RunCode { id, req }) => {
                    Reply::RunCode(self.run_code(&id, &req, events, cancel)?)
                }
                Request::Exec(Exec { id, req }) => Reply::Exec(self.exec(&id, &req, events)?),
                Request::WriteFile(WriteFile { id, path, .. }) => {
                    let input = input.ok_or_else(|| missing("bytes to write"))?;
                    Reply::WriteFile(self.write_file(&id, &path, input)?)
                }
                Request::ReadFile(ReadFile { id, path }) => {
                    let output = output.ok_or_else(|| missing("place for the bytes"))?;
                    Reply::ReadFile(self.read_file(&id, &path, output)?)
                }
                Request::ListFiles(ListFiles { id, path, depth }) => {
                    Reply::ListFiles(self.list_files(&id, &path, depth)?)
                }
                Request::Stat(Stat { id, path }) => Reply::Stat(self.stat(&id, &path)?),
                Request::Mkdir(Mkdir { id, path, .. }) => Reply::Mkdir(self.mkdir(&id, &path)?),
                Request::Remove(Remove {
                    id,
                    path,
                    recursive,
                }) => Reply::Remove(self.remove(&id, &path, recursive)?),
                Request::Rename(Rename { id, from, to }) => {
                    Reply::Rename(self.rename(&id, &from, &to)?)
                }
                Request::CollectArtifacts(CollectArtifacts { id }) => {
                    Reply::CollectArtifacts(self.collect_artifacts(&id)?)
                }
                Request::Artifacts(Artifacts { id }) => Reply::Artifacts(self.artifacts(&id)?),
                Request::ReadArtifact(ReadArtifact { id, path }) => {
                    self.artifact_path(&id, &path)?;
                    Reply::ReadArtifact(0)
                }
                // No processes are started here: an empty registry.
                Request::ProcessRemember(_) => Reply::ProcessRemember(()),
                Request::ProcessRecords(_) => Reply::ProcessRecords(vec![]),
                Request::ProcessForget(_) => Reply::ProcessForget(()),
                other => {
                    return Err(RuntimeError::Internal(format!(
                        "the fake does not answer {}",
                        other.name()
                    )))
                }
            })
        }
    }
}

fn app_with(fake: Arc<Fake>) -> Router {
    router(AppState::new(fake, TOKEN.into()))
}

fn app() -> Router {
    app_with(Arc::new(Fake::default()))
}

fn req(method: &str, uri: &str, body: impl Into<Body>) -> Request<Body> {
    Request::builder()
        .method(method)
        .uri(uri)
        .header("authorization", format!("Bearer {TOKEN}"))
        .body(body.into())
        .unwrap()
}

/// Sends `r` to `app`: status, headers, whole body.
pub(crate) async fn send(
    app: &Router,
    r: Request<Body>,
) -> (StatusCode, axum::http::HeaderMap, Vec<u8>) {
    let resp = app.clone().oneshot(r).await.unwrap();
    let status = resp.status();
    let headers = resp.headers().clone();
    let body = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap_or_default()
        .to_vec();
    (status, headers, body)
}

async fn send_json(app: &Router, r: Request<Body>) -> (StatusCode, Value) {
    let (s, h, b) = send(app, r).await;
    let ct = h.get("content-type").unwrap().to_str().unwrap();
    assert!(ct.starts_with("application/json"), "{ct}: {b:?}");
    (s, serde_json::from_slice(&b).unwrap())
}

fn error_code(v: &Value) -> &str {
    v["error"]["code"].as_str().unwrap_or("")
}

/// (method, path) of the router, in OpenAPI syntax.
fn router_routes() -> BTreeSet<(String, String)> {
    route_list()
        .into_iter()
        .map(|(m, p)| (m.to_lowercase(), p.replace("{*", "{")))
        .collect()
}

fn doc() -> Value {
    serde_json::from_str(&openapi::json()).unwrap()
}

#[test]
fn every_route_is_in_the_openapi_document_and_nothing_else() {
    let doc = doc();
    let mut documented = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for method in item.as_object().unwrap().keys() {
            if ["get", "post", "put", "delete", "patch"].contains(&method.as_str()) {
                documented.insert((method.clone(), path.clone()));
            }
        }
    }
    let routes = router_routes();
    let missing: Vec<_> = routes.difference(&documented).collect();
    let extra: Vec<_> = documented.difference(&routes).collect();
    assert!(
        missing.is_empty(),
        "routes not in the document: {missing:?}"
    );
    assert!(extra.is_empty(), "documented but not routed: {extra:?}");
    assert_eq!(routes.len(), route_list().len(), "a route is listed twice");
}

#[test]
fn the_document_has_the_bearer_scheme_and_every_ref_resolves() {
    let doc = doc();
    assert_eq!(doc["openapi"].as_str().unwrap().chars().next(), Some('3'));
    assert_eq!(
        doc["components"]["securitySchemes"]["bearer"]["scheme"],
        "bearer"
    );
    assert_eq!(doc["security"][0]["bearer"], json!([]));
    // The public routes say so.
    assert_eq!(doc["paths"]["/healthz"]["get"]["security"], json!([{}]));
    fn walk<'a>(v: &'a Value, refs: &mut Vec<&'a str>) {
        match v {
            Value::Object(m) => {
                if let Some(Value::String(r)) = m.get("$ref") {
                    refs.push(r);
                }
                m.values().for_each(|x| walk(x, refs));
            }
            Value::Array(a) => a.iter().for_each(|x| walk(x, refs)),
            _ => {}
        }
    }
    let mut refs = Vec::new();
    walk(&doc, &mut refs);
    assert!(!refs.is_empty());
    for r in refs {
        let name = r.strip_prefix("#/components/schemas/").unwrap();
        assert!(
            doc["components"]["schemas"].get(name).is_some(),
            "dangling {r}"
        );
    }
}

#[tokio::test]
async fn every_route_is_wired_with_its_method() {
    let app = app();
    for (method, path) in route_list() {
        let uri = path
            .replace("{*path}", "some/file")
            .replace("{id}", "0000000000000000")
            .replace("{ctx}", "c")
            .replace("{name}", "n");
        let uri = match path {
            p if p.contains("/files") => format!("{uri}?path=/x"),
            _ => uri,
        };
        // A JSON array is a wrong body for every JSON route: those answer 400 before any
        // call; the others reach the fake and answer from it.
        let (status, _, body) = send(&app, req(method, &uri, "[]")).await;
        assert_ne!(status, StatusCode::METHOD_NOT_ALLOWED, "{method} {path}");
        let v: Value = serde_json::from_slice(&body).unwrap_or_default();
        assert_ne!(error_code(&v), "route_not_found", "{method} {path}");
    }
}

#[tokio::test]
async fn auth_is_required_except_on_health_and_the_document() {
    let app = app();
    let anon = |m: &str, u: &str| {
        Request::builder()
            .method(m)
            .uri(u)
            .body(Body::empty())
            .unwrap()
    };
    let (s, v) = send_json(&app, anon("GET", "/v1/sandboxes")).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    assert_eq!(error_code(&v), "unauthorized");
    let wrong = Request::builder()
        .uri("/v1/sandboxes")
        .header("authorization", "Bearer nope")
        .body(Body::empty())
        .unwrap();
    let (s, h, _) = send(&app, wrong).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    assert_eq!(h["www-authenticate"], "Bearer");
    let (s, _) = send_json(&app, anon("GET", "/metrics")).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, v) = send_json(&app, anon("GET", "/healthz")).await;
    assert_eq!((s, v), (StatusCode::OK, json!({"ok": true})));
    let (s, v) = send_json(&app, anon("GET", "/openapi.json")).await;
    assert_eq!(s, StatusCode::OK);
    assert!(v["paths"].is_object());
    let lower = Request::builder()
        .uri("/v1/sandboxes")
        .header("authorization", format!("bearer {TOKEN}"))
        .body(Body::empty())
        .unwrap();
    assert_eq!(send(&app, lower).await.0, StatusCode::OK);
}

#[tokio::test]
async fn errors_are_json_with_the_status_of_their_class() {
    let app = app();
    let cases: Vec<(Request<Body>, StatusCode, &str)> = vec![
        (
            req("GET", "/v1/sandboxes/nope", ""),
            StatusCode::NOT_FOUND,
            "sandbox_not_found",
        ),
        (
            req("POST", &format!("/v1/sandboxes/{KNOWN}/pause"), ""),
            StatusCode::CONFLICT,
            "wrong_state",
        ),
        (
            req("POST", &format!("/v1/sandboxes/{KNOWN}/snapshot"), ""),
            StatusCode::TOO_MANY_REQUESTS,
            "capacity",
        ),
        (
            req("DELETE", "/v1/snapshots/x", ""),
            StatusCode::NOT_FOUND,
            "snapshot_not_found",
        ),
        (
            req(
                "GET",
                &format!("/v1/sandboxes/{KNOWN}/files/stat?path=/x"),
                "",
            ),
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
        ),
        (
            req("POST", "/v1/sandboxes", "{"),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            req("POST", "/v1/sandboxes", r#"{"templat":"x"}"#),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            req("POST", "/v1/sandboxes", r#"{"timeout_secs":"x"}"#),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            req("POST", &format!("/v1/sandboxes/{KNOWN}/fork"), ""),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            req(
                "POST",
                &format!("/v1/sandboxes/{KNOWN}/exec"),
                r#"{"argv":[]}"#,
            ),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            req(
                "POST",
                &format!("/v1/sandboxes/{KNOWN}/exec"),
                r#"{"argv":["x"],"stdin":"@@"}"#,
            ),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            req("GET", "/v1/sandboxes?bogus=1", ""),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            req("GET", "/v1/sandboxes?state=sleeping", ""),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            req("GET", "/v1/audit?limit=many", ""),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            req("GET", &format!("/v1/sandboxes/{KNOWN}/files"), ""),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            req("GET", "/v2/nothing", ""),
            StatusCode::NOT_FOUND,
            "route_not_found",
        ),
        (
            req("PATCH", "/v1/sandboxes", ""),
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
        ),
    ];
    for (r, status, code) in cases {
        let what = format!("{} {}", r.method(), r.uri());
        let (s, v) = send_json(&app, r).await;
        assert_eq!((s, error_code(&v)), (status, code), "{what}: {v}");
        assert!(v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()));
    }
    // The runtime's classes map one to one.
    use ember_runtime::ErrorClass as C;
    for (c, s) in [
        (C::NotFound, 404),
        (C::Invalid, 400),
        (C::Conflict, 409),
        (C::Capacity, 429),
        (C::Timeout, 504),
        (C::Guest, 422),
        (C::Internal, 500),
    ] {
        assert_eq!(error::status_of(c).as_u16(), s);
    }
}

#[tokio::test]
async fn request_ids_are_echoed_or_made_and_requests_counted() {
    let app = app();
    let (_, h, _) = send(&app, req("GET", "/healthz", "")).await;
    assert_eq!(h["x-request-id"].len(), 16);
    let mut r = req("GET", "/v1/sandboxes/nope", "");
    r.headers_mut()
        .insert("x-request-id", "abc-123".parse().unwrap());
    let (_, h, _) = send(&app, r).await;
    assert_eq!(h["x-request-id"], "abc-123");
    let mut r = req("GET", "/healthz", "");
    r.headers_mut()
        .insert("x-request-id", "a b\"c".parse().unwrap());
    let (_, h, _) = send(&app, r).await;
    assert_ne!(h["x-request-id"], "a b\"c");
    let (s, h, body) = send(&app, req("GET", "/metrics", "")).await;
    assert_eq!(s, StatusCode::OK);
    assert!(h["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/plain"));
    let text = String::from_utf8(body).unwrap();
    assert!(
        text.contains("ember_http_requests_total{route=\"/v1/sandboxes/{id}\",status=\"404\"} 1"),
        "{text}"
    );
    assert!(text.contains("ember_creates_total 0"));
}

fn lines(body: &[u8]) -> Vec<Value> {
    body.split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_slice(l).unwrap())
        .collect()
}

#[tokio::test]
async fn run_code_streams_events_then_an_end_line() {
    let app = app();
    let uri = format!("/v1/sandboxes/{KNOWN}/code");
    let (s, h, body) = send(&app, req("POST", &uri, r#"{"code":"1"}"#)).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(h["content-type"], "application/x-ndjson");
    let l = lines(&body);
    assert_eq!(l[0], json!({"type": "stdout", "data": "aGkK"}));
    assert_eq!(
        l[1],
        json!({"type": "end", "status": "ok", "execution_count": 1, "duration_ms": 3})
    );
    // A failure after output is the last line.
    let (s, _, body) = send(&app, req("POST", &uri, r#"{"code":"fail"}"#)).await;
    assert_eq!(s, StatusCode::OK);
    let l = lines(&body);
    assert_eq!(l[1]["type"], "error");
    assert_eq!(l[1]["error"]["code"], "timeout");
    // A failure before any output is a plain error answer.
    let (s, v) = send_json(
        &app,
        req("POST", "/v1/sandboxes/nope/code", r#"{"code":"1"}"#),
    )
    .await;
    assert_eq!(
        (s, error_code(&v)),
        (StatusCode::NOT_FOUND, "sandbox_not_found")
    );
    // Exec ends with the exit status.
    let (_, _, body) = send(
        &app,
        req(
            "POST",
            &format!("/v1/sandboxes/{KNOWN}/exec"),
            r#"{"argv":["ls","-l"]}"#,
        ),
    )
    .await;
    let l = lines(&body);
    assert_eq!(l[0], json!({"type": "started", "pid": 9}));
    assert_eq!(l[2], json!({"type": "exit", "code": 3}));
    assert_eq!(
        l[3],
        json!({"type": "end", "status": "ok", "exit": {"code": 3}})
    );
}

#[tokio::test]
async fn template_builds_stream_progress() {
    let app = app();
    let (s, _, body) = send(&app, req("POST", "/v1/templates/default/build", "")).await;
    assert_eq!(s, StatusCode::OK);
    let l = lines(&body);
    assert_eq!(l[0], json!({"type": "step", "message": "guest kernel"}));
    assert_eq!(l[1]["type"], "done");
    assert_eq!(l[1]["template"]["vm"]["memory_mib"], 512);
    let (_, _, body) = send(&app, req("POST", "/v1/templates/broken/build", "")).await;
    assert_eq!(lines(&body)[1]["error"]["code"], "template_error");
    let (s, v) = send_json(&app, req("POST", "/v1/templates/..%2Fx/build", "")).await;
    assert_eq!(
        (s, error_code(&v)),
        (StatusCode::BAD_REQUEST, "invalid_request")
    );
}

#[tokio::test]
async fn uploads_stream_into_the_guest_within_the_limit() {
    let fake = Arc::new(Fake::default());
    let app = app_with(fake.clone());
    let uri = format!("/v1/sandboxes/{KNOWN}/files?path=/a");
    // Chunked, no length: streamed.
    let chunks: Vec<Result<&'static [u8], std::io::Error>> = vec![Ok(b"hello "), Ok(b"world")];
    let body = Body::from_stream(futures_util::stream::iter(chunks));
    let (s, v) = send_json(&app, req("PUT", &uri, body)).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v, json!({"path": "/a", "bytes": 11}));
    assert_eq!(&*fake.written.lock().unwrap(), b"hello world");
    // Over the limit by its length: refused before reading.
    let mut r = req("PUT", &uri, vec![0u8; 1001]);
    r.headers_mut()
        .insert("content-length", "1001".parse().unwrap());
    let (s, v) = send_json(&app, r).await;
    assert_eq!(
        (s, error_code(&v)),
        (StatusCode::PAYLOAD_TOO_LARGE, "body_too_large")
    );
    // Over the limit while streaming.
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> = (0..5).map(|_| Ok(vec![1u8; 300])).collect();
    let body = Body::from_stream(futures_util::stream::iter(chunks));
    let (s, v) = send_json(&app, req("PUT", &uri, body)).await;
    assert_eq!(
        (s, error_code(&v)),
        (StatusCode::PAYLOAD_TOO_LARGE, "body_too_large")
    );
    // Unknown sandbox.
    let (s, v) = send_json(&app, req("PUT", "/v1/sandboxes/nope/files?path=/a", "x")).await;
    assert_eq!(
        (s, error_code(&v)),
        (StatusCode::NOT_FOUND, "sandbox_not_found")
    );
}

#[tokio::test]
async fn downloads_stream_and_missing_files_are_guest_errors() {
    let app = app();
    let (s, h, body) = send(
        &app,
        req(
            "GET",
            &format!("/v1/sandboxes/{KNOWN}/files?path=/data"),
            "",
        ),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(h["content-type"], "application/octet-stream");
    assert_eq!(body.len(), 300_000);
    let (s, v) = send_json(
        &app,
        req(
            "GET",
            &format!("/v1/sandboxes/{KNOWN}/files?path=/nope"),
            "",
        ),
    )
    .await;
    assert_eq!(
        (s, error_code(&v)),
        (StatusCode::UNPROCESSABLE_ENTITY, "guest_not_found")
    );
}

#[test]
fn list_filters_parse_metadata_keys() {
    let f = routes::list_filter(vec![
        ("state".into(), "paused".into()),
        ("all".into(), "true".into()),
        ("metadata.owner".into(), "me".into()),
    ])
    .unwrap();
    assert_eq!(f.state, Some(State::Paused));
    assert!(f.all);
    assert_eq!(f.metadata["owner"], "me");
    assert!(routes::list_filter(vec![("metadata.".into(), "x".into())]).is_err());
    assert!(routes::list_filter(vec![("all".into(), "maybe".into())]).is_err());
}

#[test]
fn the_token_file_is_created_private_and_reused() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sub/token");
    let t1 = load_or_create_token(&path).unwrap();
    assert_eq!(t1.len(), 64);
    assert!(t1.bytes().all(|c| c.is_ascii_hexdigit()));
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    assert_eq!(load_or_create_token(&path).unwrap(), t1);
    std::fs::write(&path, "short\n").unwrap();
    assert!(load_or_create_token(&path).is_err());
}

/// Serves `fake` on a free port, POSTs `code` to `/code` over a raw TCP connection, reads
/// the first stream line, hangs up; then waits (at most 10 s) until `stopped(fake)`.
async fn hang_up_during(code: &'static str, stopped: fn(&Fake) -> bool) -> Arc<Fake> {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, TOKEN).unwrap();
    let server = Server::bind(ServeOptions {
        listen: "127.0.0.1:0".parse().unwrap(),
        token_file,
        shutdown_grace: Duration::from_secs(1),
        ..Default::default()
    })
    .await
    .unwrap();
    let addr = server.local_addr();
    let fake = Arc::new(Fake::default());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(server.run_until(fake.clone(), async {
        let _ = stop_rx.await;
    }));
    let f2 = fake.clone();
    tokio::task::spawn_blocking(move || {
        use std::io::{BufRead, BufReader};
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        let body = format!(r#"{{"code":"{code}","context":"ctx1"}}"#);
        write!(
            s,
            "POST /v1/sandboxes/{KNOWN}/code HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut r = BufReader::new(s.try_clone().unwrap());
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        assert!(line.starts_with("HTTP/1.1 200"), "{line}");
        // Read until a stream line shows up, then hang up.
        loop {
            line.clear();
            r.read_line(&mut line).unwrap();
            if line.contains("\"stdout\"") {
                break;
            }
        }
        // Still connected: nothing has stopped the work yet. (Checked before the hang-up,
        // not after it: a loaded server may already have interrupted by then.)
        assert!(!stopped(&f2), "the work stopped while the client was still connected");
        drop(r);
        s.shutdown(std::net::Shutdown::Both).unwrap();
    })
    .await
    .unwrap();
    let t0 = std::time::Instant::now();
    while !stopped(&fake) {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the call went on after the client left ({} events)",
            fake.events_sent.load(Ordering::SeqCst)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _ = stop_tx.send(());
    serving.await.unwrap().unwrap();
    fake
}

/// The real thing over TCP: a client that hangs up makes the next event's send fail, the
/// call's callback returns false, which is what stops the guest work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_cancels_the_call() {
    hang_up_during("forever", |f| f.cancelled.load(Ordering::SeqCst)).await;
}

/// Code that prints nothing (`time.sleep(3600)`) produces no event to fail on: the server
/// cancels the call as soon as the response body is dropped (the runtime then closes the
/// call's agent connection, which interrupts that run). No `interrupt` of the context: it
/// could reach the next cell, which the client may have started already.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_cancels_silent_code() {
    let fake = hang_up_during("silent", |f| f.run_cancelled.load(Ordering::SeqCst)).await;
    assert!(!fake.interrupted.load(Ordering::SeqCst));
}

/// A JSON-RPC request to `/mcp` (stateless streamable HTTP), with or without the token.
fn mcp_req(body: Value, token: Option<&str>) -> Request<Body> {
    let mut b = Request::builder()
        .method("POST")
        .uri("/mcp")
        .header("host", "127.0.0.1:7070")
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .header("mcp-protocol-version", "2025-11-25");
    if let Some(t) = token {
        b = b.header("authorization", format!("Bearer {t}"));
    }
    b.body(Body::from(body.to_string())).unwrap()
}

#[tokio::test]
async fn mcp_needs_the_token_and_answers_tool_calls_over_the_backend() {
    let app = app();
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "t", "version": "0"}}});
    let (s, v) = send_json(&app, mcp_req(init.clone(), None)).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    assert_eq!(error_code(&v), "unauthorized");
    assert_eq!(
        send(&app, mcp_req(init.clone(), Some("nope"))).await.0,
        StatusCode::UNAUTHORIZED
    );
    let (s, v) = send_json(&app, mcp_req(init, Some(TOKEN))).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["result"]["serverInfo"]["name"], "ember");

    let call = |id: u32, name: &str, args: Value| {
        json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
               "params": {"name": name, "arguments": args}})
    };
    let (s, v) = send_json(
        &app,
        mcp_req(
            call(2, "run_code", json!({"sandbox_id": KNOWN, "code": "1"})),
            Some(TOKEN),
        ),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["result"]["isError"], false, "{v}");
    assert_eq!(v["result"]["content"][0]["text"], "hi\n", "{v}");
    // A runtime error is a tool error with the runtime's message.
    let (_, v) = send_json(
        &app,
        mcp_req(
            call(3, "kill_sandbox", json!({"sandbox_id": "bbbbbbbbbbbbbbbb"})),
            Some(TOKEN),
        ),
    )
    .await;
    assert_eq!(v["result"]["isError"], true, "{v}");
    assert_eq!(
        v["result"]["content"][0]["text"], "no sandbox bbbbbbbbbbbbbbbb",
        "{v}"
    );
}
