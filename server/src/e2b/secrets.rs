//! E2B's `/secrets` (`GET/POST /secrets`, `GET/POST/DELETE /secrets/{id}`) over ember's
//! secrets store. A secret's E2B id is its name (names are unique here); E2B's `metadata`
//! keeps one key, `description`. A value goes in (create, or `value` on update, which is a
//! rotation) and never comes out. Sandboxes use secrets in `network.rules` header values as
//! `${e2b.secrets.NAME}` (control.rs maps the rules; docs/network.md).

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use ember_runtime::call::{self, Io};
use ember_runtime::secrets::{SecretInfo, SecretValue};
use ember_runtime::RuntimeError;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;

use super::{E2bError, E2bJson, E2bPath, E2bState};

type Answer<T> = Result<T, E2bError>;

async fn run<T: Send + 'static>(
    st: &E2bState,
    f: impl FnOnce(&dyn crate::Backend) -> Result<T, RuntimeError> + Send + 'static,
) -> Answer<T> {
    match st.app.spawn(f).await {
        Ok(r) => r.map_err(E2bError::from),
        Err(e) => Err(E2bError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("the call failed: {e}"),
        )),
    }
}

fn time_text(ms: u64) -> String {
    humantime::format_rfc3339_millis(std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms))
        .to_string()
}

/// E2B's `Secret`.
pub fn secret_json(s: &SecretInfo) -> Value {
    let mut metadata = serde_json::Map::new();
    if let Some(d) = &s.description {
        metadata.insert("description".into(), json!(d));
    }
    json!({
        "secretID": s.name,
        "name": s.name,
        "currentVersion": s.version,
        "metadata": metadata,
        "createdAt": time_text(s.created_ms),
        "updatedAt": time_text(s.updated_ms),
    })
}

/// `NewSecret`.
#[derive(Debug, Deserialize)]
pub struct NewSecret {
    name: String,
    value: SecretValue,
    #[serde(default)]
    metadata: BTreeMap<String, String>,
}

/// `SecretUpdate` (and ember's rotation: `value`).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct SecretUpdate {
    value: Option<SecretValue>,
    metadata: Option<BTreeMap<String, String>>,
}

/// `POST /secrets`.
pub async fn create(
    State(st): State<E2bState>,
    E2bJson(body): E2bJson<NewSecret>,
) -> Answer<Response> {
    let name = body.name.to_ascii_lowercase();
    let description = body.metadata.get("description").cloned();
    let info = run(&st, move |b| {
        b.call(
            call::SecretCreate {
                name,
                value: body.value,
                description,
            },
            Io::none(),
        )
    })
    .await?;
    Ok((StatusCode::CREATED, Json(secret_json(&info))).into_response())
}

/// `GET /secrets`.
pub async fn list(State(st): State<E2bState>) -> Answer<Json<Value>> {
    let all = run(&st, |b| b.call(call::SecretList {}, Io::none())).await?;
    Ok(Json(Value::Array(all.iter().map(secret_json).collect())))
}

async fn one(st: &E2bState, id: &str) -> Answer<SecretInfo> {
    let all = run(st, |b| b.call(call::SecretList {}, Io::none())).await?;
    all.into_iter()
        .find(|s| s.name == id)
        .ok_or_else(|| E2bError::not_found(format!("secret {id} not found")))
}

/// `GET /secrets/{id}`.
pub async fn get(State(st): State<E2bState>, E2bPath(id): E2bPath<String>) -> Answer<Json<Value>> {
    Ok(Json(secret_json(&one(&st, &id).await?)))
}

/// `POST /secrets/{id}`: a `value` rotates the secret; `metadata` is not kept beyond
/// `description`, which is set at create only (refused here rather than dropped).
pub async fn update(
    State(st): State<E2bState>,
    E2bPath(id): E2bPath<String>,
    E2bJson(body): E2bJson<SecretUpdate>,
) -> Answer<Json<Value>> {
    if body.metadata.as_ref().is_some_and(|m| !m.is_empty()) {
        return Err(E2bError::invalid(
            "ember keeps a secret's metadata from its create only; updating it is not supported",
        ));
    }
    let info = match body.value {
        Some(value) => {
            run(&st, move |b| {
                b.call(call::SecretRotate { name: id, value }, Io::none())
            })
            .await?
        }
        None => one(&st, &id).await?,
    };
    Ok(Json(secret_json(&info)))
}

/// `DELETE /secrets/{id}`.
pub async fn delete(
    State(st): State<E2bState>,
    E2bPath(id): E2bPath<String>,
) -> Answer<StatusCode> {
    run(&st, move |b| {
        b.call(call::SecretDelete { name: id }, Io::none())
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}
