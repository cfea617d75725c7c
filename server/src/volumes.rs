//! The native volume routes (`/v1/volumes`): create, list, get, delete, and the content API
//! (list, stat, read and write streamed, mkdir, remove, rename). Thin: each is one runtime
//! call. A write past the volume's cap is 507 `volume_full`; a path that leaves the volume is
//! 400. See docs/volumes.md.

use axum::extract::{Path, Request, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::Json;
use bytes::Bytes;
use ember_runtime::call::{self, Io};
use ember_runtime::volumes::{VolumeEntry, VolumeInfo};
use serde::Deserialize;
use tokio::sync::mpsc;
use utoipa::{IntoParams, ToSchema};

use super::error::{ApiError, ApiJson, ApiQuery};
use super::stream::{self, pump_body, ChannelReader};
use super::types::{ErrorBody, OkBody, RenameBody, WrittenOut};
use super::AppState;

/// `POST /v1/volumes`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct VolumeCreateBody {
    /// 1 to 63 of `a-z 0-9 - _ .`, starting with a letter or digit.
    pub name: String,
    /// Most bytes its files may hold (default 1 GiB, at most 1 TiB).
    #[serde(default)]
    pub cap_bytes: Option<u64>,
}

/// `?force=`.
#[derive(Debug, Clone, Default, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ForceQuery {
    /// Delete even while sandboxes mount it (their mounts then fail).
    #[serde(default)]
    pub force: bool,
}

/// `?path=` in a volume.
#[derive(Debug, Clone, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct VolPathQuery {
    /// Path from the volume's root (`/` is the root).
    #[serde(default = "root")]
    pub path: String,
}

/// `?path=&recursive=` in a volume.
#[derive(Debug, Clone, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct VolRemoveQuery {
    /// Path from the volume's root.
    pub path: String,
    /// Remove a directory with everything in it.
    #[serde(default)]
    pub recursive: bool,
}

fn root() -> String {
    "/".into()
}

/// Creates a volume.
#[utoipa::path(post, path = "/v1/volumes", tag = "volumes",
    request_body(content = VolumeCreateBody),
    responses((status = 201, body = VolumeInfo), (status = 400, body = ErrorBody),
        (status = 409, body = ErrorBody)))]
pub async fn create_volume(
    State(st): State<AppState>,
    ApiJson(body): ApiJson<VolumeCreateBody>,
) -> Result<(StatusCode, Json<VolumeInfo>), ApiError> {
    let info = st
        .call(move |b| {
            b.call(
                call::VolumeCreate {
                    name: body.name.clone(),
                    cap_bytes: body.cap_bytes,
                },
                Io::none(),
            )
        })
        .await?;
    Ok((StatusCode::CREATED, Json(info)))
}

/// Every volume.
#[utoipa::path(get, path = "/v1/volumes", tag = "volumes",
    responses((status = 200, body = Vec<VolumeInfo>)))]
pub async fn list_volumes(State(st): State<AppState>) -> Result<Json<Vec<VolumeInfo>>, ApiError> {
    st.call(|b| b.call(call::VolumeList {}, Io::none()))
        .await
        .map(Json)
}

/// One volume: cap, usage, who mounts it.
#[utoipa::path(get, path = "/v1/volumes/{name}", tag = "volumes",
    params(("name" = String, Path, description = "Volume name")),
    responses((status = 200, body = VolumeInfo), (status = 404, body = ErrorBody)))]
pub async fn get_volume(
    State(st): State<AppState>,
    Path(name): Path<String>,
) -> Result<Json<VolumeInfo>, ApiError> {
    st.call(move |b| b.call(call::VolumeGet { name: name.clone() }, Io::none()))
        .await
        .map(Json)
}

/// Deletes a volume and its files (409 `volume_in_use` while mounted, unless `force`).
#[utoipa::path(delete, path = "/v1/volumes/{name}", tag = "volumes",
    params(("name" = String, Path, description = "Volume name"), ForceQuery),
    responses((status = 200, body = OkBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody)))]
pub async fn delete_volume(
    State(st): State<AppState>,
    Path(name): Path<String>,
    ApiQuery(q): ApiQuery<ForceQuery>,
) -> Result<Json<OkBody>, ApiError> {
    st.call(move |b| {
        b.call(
            call::VolumeDelete {
                name: name.clone(),
                force: q.force,
            },
            Io::none(),
        )
    })
    .await?;
    Ok(Json(OkBody::YES))
}

/// A directory of a volume.
#[utoipa::path(get, path = "/v1/volumes/{name}/files/list", tag = "volumes",
    params(("name" = String, Path, description = "Volume name"), VolPathQuery),
    responses((status = 200, body = Vec<VolumeEntry>), (status = 404, body = ErrorBody)))]
pub async fn list_volume_files(
    State(st): State<AppState>,
    Path(name): Path<String>,
    ApiQuery(q): ApiQuery<VolPathQuery>,
) -> Result<Json<Vec<VolumeEntry>>, ApiError> {
    st.call(move |b| {
        b.call(
            call::VolumeListFiles {
                name: name.clone(),
                path: q.path.clone(),
            },
            Io::none(),
        )
    })
    .await
    .map(Json)
}

/// Metadata of a path in a volume.
#[utoipa::path(get, path = "/v1/volumes/{name}/files/stat", tag = "volumes",
    params(("name" = String, Path, description = "Volume name"), VolPathQuery),
    responses((status = 200, body = VolumeEntry), (status = 404, body = ErrorBody)))]
pub async fn stat_volume_path(
    State(st): State<AppState>,
    Path(name): Path<String>,
    ApiQuery(q): ApiQuery<VolPathQuery>,
) -> Result<Json<VolumeEntry>, ApiError> {
    st.call(move |b| {
        b.call(
            call::VolumeStat {
                name: name.clone(),
                path: q.path.clone(),
            },
            Io::none(),
        )
    })
    .await
    .map(Json)
}

/// Streams a volume's file.
#[utoipa::path(get, path = "/v1/volumes/{name}/files", tag = "volumes",
    params(("name" = String, Path, description = "Volume name"), VolPathQuery),
    responses((status = 200, body = [u8], content_type = "application/octet-stream"),
        (status = 404, body = ErrorBody)))]
pub async fn read_volume_file(
    State(st): State<AppState>,
    Path(name): Path<String>,
    ApiQuery(q): ApiQuery<VolPathQuery>,
) -> Response {
    let b = st.backend();
    stream::raw(
        move |w| {
            b.call(
                call::VolumeReadFile {
                    name: name.to_string(),
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

/// Writes the request body (streamed) into a volume's file, made with its parents or replaced
/// atomically (507 `volume_full` past the cap).
#[utoipa::path(put, path = "/v1/volumes/{name}/files", tag = "volumes",
    params(("name" = String, Path, description = "Volume name"), VolPathQuery),
    request_body(content = [u8], content_type = "application/octet-stream"),
    responses((status = 200, body = WrittenOut), (status = 413, body = ErrorBody),
        (status = 507, description = "The volume is at its cap", body = ErrorBody)))]
pub async fn write_volume_file(
    State(st): State<AppState>,
    Path(name): Path<String>,
    ApiQuery(q): ApiQuery<VolPathQuery>,
    req: Request,
) -> Result<Json<WrittenOut>, ApiError> {
    let limit = st.inner.backend.max_upload_bytes();
    let (tx, rx) = mpsc::channel::<std::io::Result<Bytes>>(8);
    let path = q.path.clone();
    let job = st.spawn(move |b| {
        b.call(
            call::VolumeWriteFile {
                name: name.to_string(),
                path: path.to_string(),
            },
            Io::input(&mut ChannelReader::new(rx)),
        )
    });
    let over = pump_body(req.into_body().into_data_stream(), tx, limit).await;
    let r = AppState::join(job).await;
    if over {
        return Err(ApiError::too_large(limit));
    }
    Ok(Json(WrittenOut {
        path: q.path,
        bytes: r?,
    }))
}

/// Removes a path of a volume.
#[utoipa::path(delete, path = "/v1/volumes/{name}/files", tag = "volumes",
    params(("name" = String, Path, description = "Volume name"), VolRemoveQuery),
    responses((status = 200, body = OkBody), (status = 404, body = ErrorBody)))]
pub async fn remove_volume_path(
    State(st): State<AppState>,
    Path(name): Path<String>,
    ApiQuery(q): ApiQuery<VolRemoveQuery>,
) -> Result<Json<OkBody>, ApiError> {
    st.call(move |b| {
        b.call(
            call::VolumeRemove {
                name: name.clone(),
                path: q.path.clone(),
                recursive: q.recursive,
            },
            Io::none(),
        )
    })
    .await?;
    Ok(Json(OkBody::YES))
}

/// Makes a directory (and its parents) in a volume.
#[utoipa::path(post, path = "/v1/volumes/{name}/files/mkdir", tag = "volumes",
    params(("name" = String, Path, description = "Volume name"), VolPathQuery),
    responses((status = 200, body = OkBody), (status = 400, body = ErrorBody)))]
pub async fn mkdir_volume(
    State(st): State<AppState>,
    Path(name): Path<String>,
    ApiQuery(q): ApiQuery<VolPathQuery>,
) -> Result<Json<OkBody>, ApiError> {
    st.call(move |b| {
        b.call(
            call::VolumeMkdir {
                name: name.clone(),
                path: q.path.clone(),
            },
            Io::none(),
        )
    })
    .await?;
    Ok(Json(OkBody::YES))
}

/// Renames a path of a volume.
#[utoipa::path(post, path = "/v1/volumes/{name}/files/rename", tag = "volumes",
    params(("name" = String, Path, description = "Volume name")),
    request_body(content = RenameBody),
    responses((status = 200, body = OkBody), (status = 404, body = ErrorBody)))]
pub async fn rename_volume_path(
    State(st): State<AppState>,
    Path(name): Path<String>,
    ApiJson(body): ApiJson<RenameBody>,
) -> Result<Json<OkBody>, ApiError> {
    st.call(move |b| {
        b.call(
            call::VolumeRename {
                name: name.clone(),
                from: body.from.clone(),
                to: body.to.clone(),
            },
            Io::none(),
        )
    })
    .await?;
    Ok(Json(OkBody::YES))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_default_to_the_root_and_refuse_unknown_fields() {
        let q: VolPathQuery = serde_json::from_str("{}").unwrap();
        assert_eq!(q.path, "/");
        assert!(serde_json::from_str::<VolPathQuery>(r#"{"path":"/","x":1}"#).is_err());
        let b: VolumeCreateBody = serde_json::from_str(r#"{"name":"v"}"#).unwrap();
        assert_eq!(b.cap_bytes, None);
        let f: ForceQuery = serde_json::from_str("{}").unwrap();
        assert!(!f.force);
    }
}
