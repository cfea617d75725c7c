//! The native secrets routes (`/v1/secrets`): create, list, rotate, delete. A value goes in
//! (create, rotate) and never comes out: every answer is [`SecretInfo`], names and metadata.
//! What uses a secret is a sandbox's network rules (`${secrets.NAME}` in a header), applied
//! by the host-side egress proxy (docs/network.md).

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use ember_runtime::call::{self, Io};
use ember_runtime::secrets::{SecretInfo, SecretValue};
use serde::Deserialize;
use utoipa::ToSchema;

use super::error::{ApiError, ApiJson};
use super::types::{ErrorBody, OkBody};
use super::AppState;

/// `POST /v1/secrets`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SecretCreateBody {
    /// `[A-Za-z0-9_.-]`, at most 64.
    pub name: String,
    /// The value (at most 16 KiB, no control characters). Never returned.
    #[schema(value_type = String)]
    pub value: SecretValue,
    /// A note.
    #[serde(default)]
    pub description: Option<String>,
}

/// `PUT /v1/secrets/{name}`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SecretRotateBody {
    /// The new value. Never returned.
    #[schema(value_type = String)]
    pub value: SecretValue,
}

/// Creates a secret.
#[utoipa::path(post, path = "/v1/secrets", tag = "secrets",
    request_body(content = SecretCreateBody),
    responses((status = 201, body = SecretInfo), (status = 400, body = ErrorBody),
        (status = 409, body = ErrorBody)))]
pub async fn create_secret(
    State(st): State<AppState>,
    ApiJson(body): ApiJson<SecretCreateBody>,
) -> Result<(StatusCode, Json<SecretInfo>), ApiError> {
    let info = st
        .call(move |b| {
            b.call(
                call::SecretCreate {
                    name: body.name.clone(),
                    value: body.value.clone(),
                    description: body.description.clone(),
                },
                Io::none(),
            )
        })
        .await?;
    Ok((StatusCode::CREATED, Json(info)))
}

/// Every secret: names and metadata, never values.
#[utoipa::path(get, path = "/v1/secrets", tag = "secrets",
    responses((status = 200, body = Vec<SecretInfo>)))]
pub async fn list_secrets(State(st): State<AppState>) -> Result<Json<Vec<SecretInfo>>, ApiError> {
    st.call(|b| b.call(call::SecretList {}, Io::none()))
        .await
        .map(Json)
}

/// Replaces a secret's value (the next request that uses it gets the new one).
#[utoipa::path(put, path = "/v1/secrets/{name}", tag = "secrets",
    params(("name" = String, Path, description = "Secret name")),
    request_body(content = SecretRotateBody),
    responses((status = 200, body = SecretInfo), (status = 404, body = ErrorBody)))]
pub async fn rotate_secret(
    State(st): State<AppState>,
    Path(name): Path<String>,
    ApiJson(body): ApiJson<SecretRotateBody>,
) -> Result<Json<SecretInfo>, ApiError> {
    st.call(move |b| {
        b.call(
            call::SecretRotate {
                name: name.clone(),
                value: body.value.clone(),
            },
            Io::none(),
        )
    })
    .await
    .map(Json)
}

/// Deletes a secret (requests whose rules use it get a 502 from the proxy from then on).
#[utoipa::path(delete, path = "/v1/secrets/{name}", tag = "secrets",
    params(("name" = String, Path, description = "Secret name")),
    responses((status = 200, body = OkBody), (status = 404, body = ErrorBody)))]
pub async fn delete_secret(
    State(st): State<AppState>,
    Path(name): Path<String>,
) -> Result<Json<OkBody>, ApiError> {
    st.call(move |b| b.call(call::SecretDelete { name: name.clone() }, Io::none()))
        .await?;
    Ok(Json(OkBody::YES))
}
