//! The handlers: each translates one HTTP request into one runtime call (on a blocking
//! thread) and its result into JSON, NDJSON or bytes. No state of their own.

use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use ember_runtime::call::{self, Io};
use ember_runtime::call::{EventKind, RunCodeRequest};
use tokio::sync::mpsc;

use super::error::{ApiError, ApiJson, ApiQuery};
use super::stream::{self, line, pump_body, ChannelReader};
use super::types::*;
use super::AppState;
use ember_runtime::template::BuildEvent;
use ember_runtime::{
    ArtifactInfo, AuditRecord, CreateRequest, ForkRequest, ListFilter, SandboxInfo, SnapshotInfo,
    SnapshotRequest, State as SandboxState, Transition,
};

type JsonResult<T> = Result<Json<T>, ApiError>;

const NDJSON: &str = "application/x-ndjson";

// ----- server -----

/// Liveness.
#[utoipa::path(get, path = "/healthz", tag = "server", security(()),
    responses((status = 200, description = "The server answers", body = OkBody)))]
pub async fn healthz() -> Json<OkBody> {
    Json(OkBody::YES)
}

/// This document.
#[utoipa::path(get, path = "/openapi.json", tag = "server", security(()),
    responses((status = 200, description = "The OpenAPI 3 document of this API", body = Object)))]
pub async fn openapi(State(st): State<AppState>) -> Response {
    let mut resp = st.inner.openapi.clone().into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// Prometheus metrics.
#[utoipa::path(get, path = "/metrics", tag = "server",
    responses((status = 200, description = "Prometheus text exposition (0.0.4)",
        body = String, content_type = "text/plain")))]
pub async fn metrics(State(st): State<AppState>) -> Result<Response, ApiError> {
    let m = st.call(|b| b.call(call::GetMetrics {}, Io::none())).await?;
    let http = st.http_counts();
    let mut resp = super::metrics::render(&m, &http).into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    Ok(resp)
}

// ----- templates -----

/// Built templates.
#[utoipa::path(get, path = "/v1/templates", tag = "templates",
    responses((status = 200, body = Vec<TemplateSummary>)))]
pub async fn list_templates(State(st): State<AppState>) -> JsonResult<Vec<TemplateSummary>> {
    st.call(|b| b.call(call::ListTemplates {}, Io::none()))
        .await
        .map(Json)
}

/// Builds a template (a no-op when its inputs did not change), streaming progress.
#[utoipa::path(post, path = "/v1/templates/{name}/build", tag = "templates",
    params(("name" = String, Path, description = "A recipe in rootfs/templates/NAME.toml")),
    request_body(content = Option<BuildBody>),
    responses((status = 200, description = "NDJSON: `step`, `output`, `up_to_date` lines, then \
        `{\"type\":\"done\",\"template\":{..}}` or `{\"type\":\"error\",..}`",
        body = StreamLine, content_type = NDJSON)))]
pub async fn build_template(
    State(st): State<AppState>,
    Path(name): Path<String>,
    ApiJson(body): ApiJson<BuildBody>,
) -> Response {
    let b = st.backend();
    stream::ndjson(
        move |emit| {
            let t = b.call(
                call::BuildTemplate {
                    name: name.to_string(),
                    rebuild: body.rebuild,
                },
                Io::progress(&mut |ev| {
                    let v = match ev {
                        BuildEvent::Step(s) => serde_json::json!({"type": "step", "message": s}),
                        BuildEvent::Output(s) => serde_json::json!({"type": "output", "text": s}),
                        BuildEvent::UpToDate => serde_json::json!({"type": "up_to_date"}),
                    };
                    // A build cannot be cancelled half-way; it finishes (and is cached) even when
                    // the client went away.
                    let _ = emit(line(&v));
                }),
            )?;
            Ok(serde_json::json!({"type": "done", "template": t}))
        },
        None,
    )
    .await
}

// ----- sandboxes -----

/// Creates a sandbox from a template or a named snapshot; answers once its guest answers.
#[utoipa::path(post, path = "/v1/sandboxes", tag = "sandboxes",
    request_body = CreateRequest,
    responses((status = 201, body = SandboxInfo),
        (status = 404, description = "No such template or snapshot", body = ErrorBody),
        (status = 429, description = "At capacity", body = ErrorBody)))]
pub async fn create(
    State(st): State<AppState>,
    ApiJson(req): ApiJson<CreateRequest>,
) -> Result<(StatusCode, Json<SandboxInfo>), ApiError> {
    let info = st
        .call(move |b| b.call(call::Create { req: req.clone() }, Io::none()))
        .await?;
    Ok((StatusCode::CREATED, Json(info)))
}

fn parse_bool(k: &str, v: &str) -> Result<bool, ApiError> {
    match v {
        "" | "true" | "1" => Ok(true),
        "false" | "0" => Ok(false),
        _ => Err(ApiError::invalid(format!(
            "{k}={v:?}: expected true or false"
        ))),
    }
}

/// The list filter of `?state=&all=&metadata.KEY=VALUE`.
pub fn list_filter(pairs: Vec<(String, String)>) -> Result<ListFilter, ApiError> {
    let mut f = ListFilter::default();
    for (k, v) in pairs {
        match k.as_str() {
            "state" if v.is_empty() => {}
            "state" => {
                f.state = Some(SandboxState::parse(&v).ok_or_else(|| {
                    ApiError::invalid(format!(
                        "state={v:?}: expected one of {}",
                        SandboxState::ALL.map(|s| s.as_str()).join(", ")
                    ))
                })?)
            }
            "all" => f.all = parse_bool(&k, &v)?,
            _ => match k.strip_prefix("metadata.") {
                Some(key) if !key.is_empty() => {
                    f.metadata.insert(key.to_string(), v);
                }
                _ => {
                    return Err(ApiError::invalid(format!(
                        "unknown query parameter {k:?} (expected state, all, metadata.KEY)"
                    )))
                }
            },
        }
    }
    Ok(f)
}

/// Sandboxes, newest first (live ones unless `all` or a final `state`).
#[utoipa::path(get, path = "/v1/sandboxes", tag = "sandboxes",
    params(("state" = Option<SandboxState>, Query, description = "Only in this state"),
        ("all" = Option<bool>, Query, description = "Include stopped and failed ones"),
        ("metadata.KEY" = Option<String>, Query,
            description = "Only those whose metadata has KEY=VALUE (repeatable)")),
    responses((status = 200, body = Vec<SandboxInfo>)))]
pub async fn list_sandboxes(
    State(st): State<AppState>,
    ApiQuery(pairs): ApiQuery<Vec<(String, String)>>,
) -> JsonResult<Vec<SandboxInfo>> {
    let f = list_filter(pairs)?;
    st.call(move |b| b.call(call::List { filter: f.clone() }, Io::none()))
        .await
        .map(Json)
}

/// One sandbox.
#[utoipa::path(get, path = "/v1/sandboxes/{id}", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id")),
    responses((status = 200, body = SandboxInfo), (status = 404, body = ErrorBody)))]
pub async fn get_sandbox(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> JsonResult<SandboxInfo> {
    st.call(move |b| b.call(call::Get { id: id.to_string() }, Io::none()))
        .await
        .map(Json)
}

/// Kills a sandbox (its artifacts are collected first).
#[utoipa::path(delete, path = "/v1/sandboxes/{id}", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id")),
    responses((status = 200, body = SandboxInfo), (status = 404, body = ErrorBody)))]
pub async fn kill(State(st): State<AppState>, Path(id): Path<String>) -> JsonResult<SandboxInfo> {
    st.call(move |b| b.call(call::Kill { id: id.to_string() }, Io::none()))
        .await
        .map(Json)
}

/// Pauses a sandbox (snapshot to disk; its VMM exits). Any call resumes it.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/pause", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id")),
    responses((status = 200, body = SandboxInfo), (status = 409, body = ErrorBody)))]
pub async fn pause(State(st): State<AppState>, Path(id): Path<String>) -> JsonResult<SandboxInfo> {
    st.call(move |b| b.call(call::Pause { id: id.to_string() }, Io::none()))
        .await
        .map(Json)
}

/// Resumes a paused sandbox (from its memory; with `reboot`, booted from its disk alone).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/resume", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id")),
    request_body(content = Option<ResumeBody>),
    responses((status = 200, body = SandboxInfo), (status = 409, body = ErrorBody)))]
pub async fn resume(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<ResumeBody>,
) -> JsonResult<SandboxInfo> {
    st.call(move |b| {
        b.call(
            call::Resume {
                id: id.to_string(),
                reboot: body.reboot,
            },
            Io::none(),
        )
    })
    .await
    .map(Json)
}

/// Sets the timeout to `timeout_secs` from now.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/timeout", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id")),
    request_body = TimeoutBody,
    responses((status = 200, body = SandboxInfo), (status = 400, body = ErrorBody)))]
pub async fn set_timeout(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<TimeoutBody>,
) -> JsonResult<SandboxInfo> {
    st.call(move |b| {
        b.call(
            call::SetTimeout {
                id: id.to_string(),
                secs: body.timeout_secs,
                on_timeout: body.on_timeout,
            },
            Io::none(),
        )
    })
    .await
    .map(Json)
}

/// The state history of a sandbox.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/history", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id")),
    responses((status = 200, body = Vec<Transition>), (status = 404, body = ErrorBody)))]
pub async fn history(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> JsonResult<Vec<Transition>> {
    st.call(move |b| b.call(call::History { id: id.to_string() }, Io::none()))
        .await
        .map(Json)
}

/// Forks a running sandbox into `count` new ones continuing from its current state.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/fork", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id")),
    request_body = ForkRequest,
    responses((status = 201, body = Vec<SandboxInfo>), (status = 409, body = ErrorBody)))]
pub async fn fork(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<ForkRequest>,
) -> Result<(StatusCode, Json<Vec<SandboxInfo>>), ApiError> {
    let v = st
        .call(move |b| {
            b.call(
                call::Fork {
                    id: id.to_string(),
                    req: req.clone(),
                },
                Io::none(),
            )
        })
        .await?;
    Ok((StatusCode::CREATED, Json(v)))
}

// ----- snapshots -----

/// Takes a durable named snapshot of a running sandbox (which keeps running).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/snapshot", tag = "snapshots",
    params(("id" = String, Path, description = "Sandbox id")),
    request_body(content = Option<SnapshotRequest>),
    responses((status = 201, body = SnapshotInfo), (status = 409, body = ErrorBody)))]
pub async fn snapshot(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<SnapshotRequest>,
) -> Result<(StatusCode, Json<SnapshotInfo>), ApiError> {
    let s = st
        .call(move |b| {
            b.call(
                call::TakeSnapshot {
                    id: id.to_string(),
                    req: req.clone(),
                },
                Io::none(),
            )
        })
        .await?;
    Ok((StatusCode::CREATED, Json(s)))
}

/// Named snapshots.
#[utoipa::path(get, path = "/v1/snapshots", tag = "snapshots",
    responses((status = 200, body = Vec<SnapshotInfo>)))]
pub async fn list_snapshots(State(st): State<AppState>) -> JsonResult<Vec<SnapshotInfo>> {
    st.call(|b| b.call(call::ListSnapshots {}, Io::none()))
        .await
        .map(Json)
}

/// Deletes a named snapshot.
#[utoipa::path(delete, path = "/v1/snapshots/{name}", tag = "snapshots",
    params(("name" = String, Path, description = "Snapshot name")),
    responses((status = 200, body = OkBody), (status = 404, body = ErrorBody)))]
pub async fn delete_snapshot(
    State(st): State<AppState>,
    Path(name): Path<String>,
) -> JsonResult<OkBody> {
    st.call(move |b| {
        b.call(
            call::DeleteSnapshot {
                name: name.to_string(),
            },
            Io::none(),
        )
    })
    .await?;
    Ok(Json(OkBody::YES))
}

// ----- contexts -----

/// The code contexts of a sandbox.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/contexts", tag = "contexts",
    params(("id" = String, Path, description = "Sandbox id")),
    responses((status = 200, body = Vec<ContextOut>)))]
pub async fn list_contexts(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> JsonResult<Vec<ContextOut>> {
    let v = st
        .call(move |b| b.call(call::ContextList { id: id.to_string() }, Io::none()))
        .await?;
    Ok(Json(v.into_iter().map(ContextOut::from).collect()))
}

/// Creates a code context.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/contexts", tag = "contexts",
    params(("id" = String, Path, description = "Sandbox id")),
    request_body = ContextBody,
    responses((status = 201, body = ContextOut), (status = 400, body = ErrorBody)))]
pub async fn create_context(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<ContextBody>,
) -> Result<(StatusCode, Json<ContextOut>), ApiError> {
    let c = st
        .call(move |b| {
            b.call(
                call::ContextCreate {
                    id: id.to_string(),
                    language: body.language.to_string(),
                    cwd: body.cwd.as_deref().map(|s| s.to_string()),
                    context: None,
                },
                Io::none(),
            )
        })
        .await?;
    Ok((StatusCode::CREATED, Json(c.into())))
}

/// Restarts a context (its state is lost).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/contexts/{ctx}/restart", tag = "contexts",
    params(("id" = String, Path, description = "Sandbox id"),
        ("ctx" = String, Path, description = "Context id")),
    responses((status = 200, body = OkBody), (status = 422, body = ErrorBody)))]
pub async fn restart_context(
    State(st): State<AppState>,
    Path((id, ctx)): Path<(String, String)>,
) -> JsonResult<OkBody> {
    st.call(move |b| {
        b.call(
            call::ContextRestart {
                id: id.to_string(),
                context: ctx.to_string(),
            },
            Io::none(),
        )
    })
    .await?;
    Ok(Json(OkBody::YES))
}

/// Removes a context.
#[utoipa::path(delete, path = "/v1/sandboxes/{id}/contexts/{ctx}", tag = "contexts",
    params(("id" = String, Path, description = "Sandbox id"),
        ("ctx" = String, Path, description = "Context id")),
    responses((status = 200, body = OkBody), (status = 422, body = ErrorBody)))]
pub async fn remove_context(
    State(st): State<AppState>,
    Path((id, ctx)): Path<(String, String)>,
) -> JsonResult<OkBody> {
    st.call(move |b| {
        b.call(
            call::ContextRemove {
                id: id.to_string(),
                context: ctx.to_string(),
            },
            Io::none(),
        )
    })
    .await?;
    Ok(Json(OkBody::YES))
}

/// Interrupts the code running in a context (SIGINT: `KeyboardInterrupt`).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/contexts/{ctx}/interrupt", tag = "contexts",
    params(("id" = String, Path, description = "Sandbox id"),
        ("ctx" = String, Path, description = "Context id")),
    responses((status = 200, body = OkBody), (status = 422, body = ErrorBody)))]
pub async fn interrupt(
    State(st): State<AppState>,
    Path((id, ctx)): Path<(String, String)>,
) -> JsonResult<OkBody> {
    st.call(move |b| {
        b.call(
            call::Interrupt {
                id: id.to_string(),
                context: ctx.to_string(),
            },
            Io::none(),
        )
    })
    .await?;
    Ok(Json(OkBody::YES))
}

// ----- code and programs -----

/// Runs code in a context; the events stream as the guest produces them.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/code", tag = "code",
    params(("id" = String, Path, description = "Sandbox id")),
    request_body = RunCodeBody,
    responses((status = 200, description = "NDJSON: agent events (`stdout`, `stderr`, `result`, \
        `display`, `exception`, …), then `{\"type\":\"end\",\"status\",\"execution_count\",\
        \"duration_ms\"}` or `{\"type\":\"error\",\"error\":{..}}`",
        body = StreamLine, content_type = NDJSON),
        (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn run_code(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<RunCodeBody>,
) -> Response {
    let req = RunCodeRequest::from(body);
    // Code that prints nothing gives no event whose send could fail: when the client goes
    // away, the call is cancelled (its agent connection closed, which interrupts this run in
    // the guest and no later one).
    let cancel = call::Cancel::new();
    let abandoned = cancel.clone();
    let on_abandon: stream::OnAbandon = Box::new(move || abandoned.fire());
    let b = st.backend();
    stream::ndjson(
        move |emit| {
            let end = b.call(
                call::RunCode {
                    id: id.to_string(),
                    req: req.clone(),
                },
                Io::events(&mut |ev| emit(line(ev))).with_cancel(cancel.clone()),
            )?;
            Ok(serde_json::json!({
                "type": "end",
                "status": end.status,
                "execution_count": end.execution_count,
                "duration_ms": end.duration_ms,
            }))
        },
        Some(on_abandon),
    )
    .await
}

/// Runs a program; its output streams as it is produced.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/exec", tag = "code",
    params(("id" = String, Path, description = "Sandbox id")),
    request_body = ExecBody,
    responses((status = 200, description = "NDJSON: `started`, `stdout`, `stderr`, `exit` events, \
        then `{\"type\":\"end\",\"status\",\"exit\"}` or `{\"type\":\"error\",\"error\":{..}}`",
        body = StreamLine, content_type = NDJSON),
        (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn exec(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<ExecBody>,
) -> Result<Response, ApiError> {
    let req = body.into_request()?;
    let (b, b2, id2) = (st.backend(), st.backend(), id.clone());
    // A program that prints nothing gives no event whose send could fail: when the client
    // goes away, kill its process group (its pid comes with the first event).
    let pid = std::sync::Arc::new(std::sync::Mutex::new(None::<i32>));
    let pid2 = pid.clone();
    let on_abandon: stream::OnAbandon = Box::new(move || {
        let p = *pid2.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = p {
            if let Err(e) = b2.call(
                call::ProcessSignal {
                    id: id2.to_string(),
                    pid: p,
                    signal: libc::SIGKILL,
                },
                Io::none(),
            ) {
                tracing::info!("killing {id2}/{p} after the client left: {e}");
            }
        }
    });
    Ok(stream::ndjson(
        move |emit| {
            let mut exit = None;
            let status = b.call(
                call::Exec {
                    id: id.to_string(),
                    req: req.clone(),
                },
                Io::events(&mut |ev| {
                    match ev {
                        EventKind::Exit(s) => exit = Some(*s),
                        EventKind::Started { pid: p } => {
                            *pid.lock().unwrap_or_else(|e| e.into_inner()) = Some(*p)
                        }
                        _ => {}
                    }
                    emit(line(ev))
                }),
            )?;
            Ok(serde_json::json!({"type": "end", "status": status, "exit": exit}))
        },
        Some(on_abandon),
    )
    .await)
}

// ----- files -----

fn content_length(req: &Request) -> Option<u64> {
    req.headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
}

/// Writes the request body (streamed) into a guest file, replacing it atomically.
#[utoipa::path(put, path = "/v1/sandboxes/{id}/files", tag = "files",
    params(("id" = String, Path, description = "Sandbox id"), PathQuery),
    request_body(content = [u8], content_type = "application/octet-stream"),
    responses((status = 200, body = WrittenOut),
        (status = 413, description = "Over the server's upload limit", body = ErrorBody)))]
pub async fn upload(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
    req: Request,
) -> JsonResult<WrittenOut> {
    let limit = st.inner.backend.max_upload_bytes();
    if content_length(&req).is_some_and(|n| n > limit) {
        return Err(ApiError::too_large(limit));
    }
    let (tx, rx) = mpsc::channel::<std::io::Result<Bytes>>(8);
    let path = q.path.clone();
    let job = st.spawn(move |b| {
        b.call(
            call::WriteFile {
                id: id.to_string(),
                path: path.to_string(),
                user: Default::default(),
            },
            Io::input(&mut ChannelReader::new(rx)),
        )
    });
    let over = pump_body(req.into_body().into_data_stream(), tx, limit).await;
    let r = AppState::join(job).await;
    if over {
        return Err(ApiError::too_large(limit));
    }
    let bytes = r?;
    Ok(Json(WrittenOut {
        path: q.path,
        bytes,
    }))
}

/// Streams a guest file.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/files", tag = "files",
    params(("id" = String, Path, description = "Sandbox id"), PathQuery),
    responses((status = 200, body = [u8], content_type = "application/octet-stream"),
        (status = 422, description = "No such file (`guest_not_found`), a directory, …",
            body = ErrorBody)))]
pub async fn download(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> Response {
    let b = st.backend();
    stream::raw(
        move |w| {
            b.call(
                call::ReadFile {
                    id: id.to_string(),
                    path: q.path.to_string(),
                },
                Io::output(w),
            )?;
            Ok(())
        },
        None,
    )
    .await
}

/// Lists a guest directory.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/files/list", tag = "files",
    params(("id" = String, Path, description = "Sandbox id"), ListQuery),
    responses((status = 200, body = Vec<EntryOut>), (status = 422, body = ErrorBody)))]
pub async fn list_files(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> JsonResult<Vec<EntryOut>> {
    let v = st
        .call(move |b| {
            b.call(
                call::ListFiles {
                    id: id.to_string(),
                    path: q.path.to_string(),
                    depth: q.depth.unwrap_or(1),
                },
                Io::none(),
            )
        })
        .await?;
    Ok(Json(v.into_iter().map(EntryOut::from).collect()))
}

/// Metadata of a guest path.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/files/stat", tag = "files",
    params(("id" = String, Path, description = "Sandbox id"), PathQuery),
    responses((status = 200, body = StatOut), (status = 422, body = ErrorBody)))]
pub async fn stat(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> JsonResult<StatOut> {
    let s = st
        .call(move |b| {
            b.call(
                call::Stat {
                    id: id.to_string(),
                    path: q.path.to_string(),
                },
                Io::none(),
            )
        })
        .await?;
    Ok(Json(s.into()))
}

/// Creates a guest directory with its parents.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/files/mkdir", tag = "files",
    params(("id" = String, Path, description = "Sandbox id")),
    request_body = MkdirBody,
    responses((status = 200, body = OkBody), (status = 422, body = ErrorBody)))]
pub async fn mkdir(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<MkdirBody>,
) -> JsonResult<OkBody> {
    st.call(move |b| {
        b.call(
            call::Mkdir {
                id: id.to_string(),
                path: body.path.to_string(),
                user: Default::default(),
            },
            Io::none(),
        )
    })
    .await?;
    Ok(Json(OkBody::YES))
}

/// Removes a guest path.
#[utoipa::path(delete, path = "/v1/sandboxes/{id}/files", tag = "files",
    params(("id" = String, Path, description = "Sandbox id"), RemoveQuery),
    responses((status = 200, body = OkBody), (status = 422, body = ErrorBody)))]
pub async fn remove(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<RemoveQuery>,
) -> JsonResult<OkBody> {
    st.call(move |b| {
        b.call(
            call::Remove {
                id: id.to_string(),
                path: q.path.to_string(),
                recursive: q.recursive,
            },
            Io::none(),
        )
    })
    .await?;
    Ok(Json(OkBody::YES))
}

/// Renames a guest path.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/files/rename", tag = "files",
    params(("id" = String, Path, description = "Sandbox id")),
    request_body = RenameBody,
    responses((status = 200, body = OkBody), (status = 422, body = ErrorBody)))]
pub async fn rename(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<RenameBody>,
) -> JsonResult<OkBody> {
    st.call(move |b| {
        b.call(
            call::Rename {
                id: id.to_string(),
                from: body.from.to_string(),
                to: body.to.to_string(),
            },
            Io::none(),
        )
    })
    .await?;
    Ok(Json(OkBody::YES))
}

// ----- artifacts -----

/// The artifacts kept for a sandbox (also after it ended).
#[utoipa::path(get, path = "/v1/sandboxes/{id}/artifacts", tag = "artifacts",
    params(("id" = String, Path, description = "Sandbox id")),
    responses((status = 200, body = Vec<ArtifactInfo>), (status = 404, body = ErrorBody)))]
pub async fn list_artifacts(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> JsonResult<Vec<ArtifactInfo>> {
    st.call(move |b| b.call(call::Artifacts { id: id.to_string() }, Io::none()))
        .await
        .map(Json)
}

/// Copies the sandbox's outputs directory to the host now.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/artifacts/collect", tag = "artifacts",
    params(("id" = String, Path, description = "Sandbox id")),
    responses((status = 200, body = Vec<ArtifactInfo>), (status = 409, body = ErrorBody)))]
pub async fn collect_artifacts(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> JsonResult<Vec<ArtifactInfo>> {
    st.call(move |b| b.call(call::CollectArtifacts { id: id.to_string() }, Io::none()))
        .await
        .map(Json)
}

/// Downloads one artifact (from the host; the sandbox may have ended).
#[utoipa::path(get, path = "/v1/sandboxes/{id}/artifacts/{path}", tag = "artifacts",
    params(("id" = String, Path, description = "Sandbox id"),
        ("path" = String, Path, description = "Path relative to the outputs directory, as listed")),
    responses((status = 200, body = [u8], content_type = "application/octet-stream"),
        (status = 404, body = ErrorBody)))]
pub async fn get_artifact(
    State(st): State<AppState>,
    Path((id, path)): Path<(String, String)>,
) -> Response {
    let b = st.backend();
    stream::raw(
        move |w| {
            b.call(
                call::ReadArtifact {
                    id: id.to_string(),
                    path: path.to_string(),
                },
                Io::output(w),
            )?;
            Ok(())
        },
        None,
    )
    .await
}

// ----- audit -----

/// Audit records of one sandbox.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/audit", tag = "audit",
    params(("id" = String, Path, description = "Sandbox id"), SandboxAuditQuery),
    responses((status = 200, body = Vec<AuditRecord>), (status = 404, body = ErrorBody)))]
pub async fn sandbox_audit(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<SandboxAuditQuery>,
) -> JsonResult<Vec<AuditRecord>> {
    st.call(move |b| {
        let records = b.call(
            call::Audit {
                filter: q.filter(id.clone()),
            },
            Io::none(),
        )?;
        // No records: an unknown sandbox is a 404 (a known one, whose host may be gone, is
        // answered from the records alone).
        if records.is_empty() {
            b.call(call::Get { id: id.to_string() }, Io::none())?;
        }
        Ok(records)
    })
    .await
    .map(Json)
}

/// Audit records of every sandbox.
#[utoipa::path(get, path = "/v1/audit", tag = "audit", params(AuditQuery),
    responses((status = 200, body = Vec<AuditRecord>)))]
pub async fn audit(
    State(st): State<AppState>,
    ApiQuery(q): ApiQuery<AuditQuery>,
) -> JsonResult<Vec<AuditRecord>> {
    st.call(move |b| b.call(call::Audit { filter: q.into() }, Io::none()))
        .await
        .map(Json)
}
