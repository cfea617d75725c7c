//! E2B's volumes: the control plane (`POST/GET /volumes`, `GET/DELETE /volumes/{id}`, with the
//! API key) and the content API (`/volumecontent/{id}/file|path|dir`, with the volume's own
//! token), as the E2B SDKs' `Volume` class calls them, over ember's volume calls. A volume's
//! E2B id is its name; its token is derived from the server's token and the name (like a
//! sandbox's traffic token), so it opens that volume's content and nothing else. The SDK finds
//! the content API at `E2B_VOLUME_API_URL` (set it to the server's URL; docs/e2b.md).

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use ember_runtime::call::{self, Io};
use ember_runtime::volumes::{VolumeEntry, VolumeInfo};
use ember_runtime::RuntimeError;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::{E2bError, E2bJson, E2bPath, E2bQuery, E2bState};
use crate::stream::{self, pump_body, ChannelReader};

type Answer<T> = Result<T, E2bError>;

async fn run<T: Send + 'static>(
    st: &E2bState,
    f: impl FnOnce(&dyn crate::Backend) -> Result<T, RuntimeError> + Send + 'static,
) -> Answer<T> {
    match st.app.spawn(f).await {
        Ok(r) => r.map_err(volume_error),
        Err(e) => Err(E2bError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("the call failed: {e}"),
        )),
    }
}

fn volume_error(e: RuntimeError) -> E2bError {
    if e.code() == "volume_full" {
        return E2bError::new(StatusCode::INSUFFICIENT_STORAGE, e.to_string());
    }
    E2bError::from(e)
}

/// Volume `name`'s content token.
pub fn volume_token(st: &E2bState, name: &str) -> String {
    crate::tokens::derive_token(&st.app.inner.token, "volume-content", name)
}

/// Whether `path` is content-API traffic of a volume whose token `bearer` is.
pub fn content_token_ok(st: &E2bState, path: &str, bearer: Option<&str>) -> bool {
    let Some(rest) = path.strip_prefix("/volumecontent/") else {
        return false;
    };
    let name = rest.split('/').next().unwrap_or_default();
    match bearer {
        Some(b) if !name.is_empty() => crate::same(b.as_bytes(), volume_token(st, name).as_bytes()),
        _ => false,
    }
}

fn with_token(st: &E2bState, v: &VolumeInfo) -> Value {
    let mut o = json!({
        "volumeID": v.name,
        "name": v.name,
        "token": volume_token(st, &v.name),
    });
    if let Some(d) = st.domain() {
        o["domain"] = json!(d);
    }
    o
}

fn entry_json(e: &VolumeEntry) -> Value {
    json!({
        "name": e.name,
        "type": if e.kind == "dir" { "directory" } else { "file" },
        "path": e.path,
        "size": e.size,
        "mode": e.mode,
        "uid": 0,
        "gid": 0,
        "atime": e.modified_at,
        "mtime": e.modified_at,
        "ctime": e.modified_at,
    })
}

/// `NewVolume`.
#[derive(Debug, Deserialize)]
pub struct NewVolume {
    name: String,
}

/// `POST /volumes`.
pub async fn create(
    State(st): State<E2bState>,
    E2bJson(body): E2bJson<NewVolume>,
) -> Answer<Response> {
    let info = run(&st, move |b| {
        b.call(
            call::VolumeCreate {
                name: body.name.clone(),
                cap_bytes: None,
            },
            Io::none(),
        )
    })
    .await?;
    Ok((StatusCode::CREATED, Json(with_token(&st, &info))).into_response())
}

/// `GET /volumes`.
pub async fn list(State(st): State<E2bState>) -> Answer<Json<Value>> {
    let all = run(&st, |b| b.call(call::VolumeList {}, Io::none())).await?;
    Ok(Json(Value::Array(
        all.iter()
            .map(|v| json!({"volumeID": v.name, "name": v.name}))
            .collect(),
    )))
}

/// `GET /volumes/{id}`.
pub async fn get(State(st): State<E2bState>, E2bPath(id): E2bPath<String>) -> Answer<Json<Value>> {
    let info = run(&st, move |b| {
        b.call(call::VolumeGet { name: id.clone() }, Io::none())
    })
    .await?;
    Ok(Json(with_token(&st, &info)))
}

/// `DELETE /volumes/{id}` (refused while mounted: E2B has no force).
pub async fn delete(
    State(st): State<E2bState>,
    E2bPath(id): E2bPath<String>,
) -> Answer<StatusCode> {
    run(&st, move |b| {
        b.call(
            call::VolumeDelete {
                name: id.clone(),
                force: false,
            },
            Io::none(),
        )
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `?path=` (and the SDK's other query fields, which ember does not use: owners and modes are
/// not kept; `force` makes parents).
#[derive(Debug, Deserialize)]
pub struct PathQuery {
    path: String,
    #[serde(default)]
    depth: Option<u32>,
    #[serde(default)]
    force: Option<bool>,
}

async fn stat(st: &E2bState, id: String, path: String) -> Answer<Value> {
    let e = run(st, move |b| {
        b.call(
            call::VolumeStat {
                name: id.clone(),
                path: path.clone(),
            },
            Io::none(),
        )
    })
    .await?;
    Ok(entry_json(&e))
}

/// `GET /volumecontent/{id}/file`.
pub async fn read_file(
    State(st): State<E2bState>,
    E2bPath(id): E2bPath<String>,
    E2bQuery(q): E2bQuery<PathQuery>,
) -> Response {
    let b = st.app.backend();
    stream::raw(
        move |w| {
            b.call(
                call::VolumeReadFile {
                    name: id.clone(),
                    path: q.path.clone(),
                },
                Io::output(w),
            )?;
            Ok(())
        },
        None,
    )
    .await
}

/// `PUT /volumecontent/{id}/file`: the body, raw, replaces the file (parents made).
pub async fn write_file(
    State(st): State<E2bState>,
    E2bPath(id): E2bPath<String>,
    E2bQuery(q): E2bQuery<PathQuery>,
    req: Request,
) -> Answer<Response> {
    let limit = st.app.backend().max_upload_bytes();
    let (tx, rx) = mpsc::channel::<std::io::Result<Bytes>>(8);
    let (id2, path2) = (id.clone(), q.path.clone());
    let job = st.app.spawn(move |b| {
        b.call(
            call::VolumeWriteFile {
                name: id2.clone(),
                path: path2.clone(),
            },
            Io::input(&mut ChannelReader::new(rx)),
        )
    });
    let over = pump_body(req.into_body().into_data_stream(), tx, limit).await;
    let r = job.await.map_err(|e| {
        E2bError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("the upload failed: {e}"),
        )
    })?;
    if over {
        return Err(E2bError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the body is over the limit of {limit} bytes"),
        ));
    }
    r.map_err(volume_error)?;
    let s = stat(&st, id, q.path).await?;
    Ok((StatusCode::CREATED, Json(s)).into_response())
}

/// `GET /volumecontent/{id}/path`.
pub async fn stat_path(
    State(st): State<E2bState>,
    E2bPath(id): E2bPath<String>,
    E2bQuery(q): E2bQuery<PathQuery>,
) -> Answer<Json<Value>> {
    Ok(Json(stat(&st, id, q.path).await?))
}

/// `PATCH /volumecontent/{id}/path` (owner and mode: not kept; answers the entry).
pub async fn patch_path(
    State(st): State<E2bState>,
    E2bPath(id): E2bPath<String>,
    E2bQuery(q): E2bQuery<PathQuery>,
) -> Answer<Json<Value>> {
    Ok(Json(stat(&st, id, q.path).await?))
}

/// `DELETE /volumecontent/{id}/path` (a directory with its contents).
pub async fn remove_path(
    State(st): State<E2bState>,
    E2bPath(id): E2bPath<String>,
    E2bQuery(q): E2bQuery<PathQuery>,
) -> Answer<StatusCode> {
    run(&st, move |b| {
        b.call(
            call::VolumeRemove {
                name: id.clone(),
                path: q.path.clone(),
                recursive: true,
            },
            Io::none(),
        )
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `GET /volumecontent/{id}/dir` (`depth` 1 to 16, default 1).
pub async fn list_dir(
    State(st): State<E2bState>,
    E2bPath(id): E2bPath<String>,
    E2bQuery(q): E2bQuery<PathQuery>,
) -> Answer<Json<Value>> {
    let depth = q.depth.unwrap_or(1).clamp(1, 16);
    let all = run(&st, move |b| {
        let mut out = Vec::new();
        let mut level = vec![q.path.clone()];
        for _ in 0..depth {
            let mut next = Vec::new();
            for dir in level {
                for e in b.call(
                    call::VolumeListFiles {
                        name: id.clone(),
                        path: dir,
                    },
                    Io::none(),
                )? {
                    if e.kind == "dir" {
                        next.push(e.path.clone());
                    }
                    out.push(e);
                }
            }
            level = next;
        }
        Ok(out)
    })
    .await?;
    Ok(Json(Value::Array(all.iter().map(entry_json).collect())))
}

/// `POST /volumecontent/{id}/dir` (parents are always made; an existing directory is fine
/// with `force`, else 409).
pub async fn make_dir(
    State(st): State<E2bState>,
    E2bPath(id): E2bPath<String>,
    E2bQuery(q): E2bQuery<PathQuery>,
) -> Answer<Response> {
    let (id2, path2) = (id.clone(), q.path.clone());
    let existed = stat(&st, id.clone(), q.path.clone()).await.is_ok();
    if existed && q.force != Some(true) {
        return Err(E2bError::new(
            StatusCode::CONFLICT,
            format!("{} exists already", q.path),
        ));
    }
    run(&st, move |b| {
        b.call(
            call::VolumeMkdir {
                name: id2.clone(),
                path: path2.clone(),
            },
            Io::none(),
        )
    })
    .await?;
    let s = stat(&st, id, q.path).await?;
    Ok((StatusCode::CREATED, Json(s)).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_have_the_sdks_shape() {
        let e = VolumeEntry {
            path: "/d".into(),
            name: "d".into(),
            kind: "dir".into(),
            size: 0,
            mode: 0o755,
            modified_at: "2026-01-01T00:00:00.000Z".into(),
        };
        let v = entry_json(&e);
        for k in [
            "name", "type", "path", "size", "mode", "uid", "gid", "atime", "mtime", "ctime",
        ] {
            assert!(v.get(k).is_some(), "{k} missing: {v}");
        }
        assert_eq!(v["type"], "directory");
    }
}
