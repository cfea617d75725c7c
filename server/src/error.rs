//! Every error the API answers is `{"error": {"code", "message"}}` with a status that says
//! whose fault it is: the runtime's [`ErrorClass`] decides for runtime errors; malformed
//! requests are 400 `invalid_request`; bodies over a limit are 413 `body_too_large`.
//! Errors axum produces itself (a bad path parameter, an unknown method) are rewritten into
//! the same shape by [`jsonify`].

use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use utoipa::ToSchema;

use axum::body::Body;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde::de::DeserializeOwned;

use ember_runtime::{ErrorClass, RuntimeError};

/// Largest JSON request body (code, base64 stdin): 64 MiB. Files go through the streamed
/// upload, which has its own limit.
pub const MAX_JSON_BYTES: usize = 64 << 20;

/// `{"error": {"code", "message"}}`: every error response.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// An error's code and message.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ErrorDetail {
    /// Stable, machine-readable (`sandbox_not_found`, `wrong_state`, `invalid_request`, …).
    pub code: String,
    /// What failed, for people.
    pub message: String,
}

/// An error answer.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// The stable code.
    pub code: Cow<'static, str>,
    /// The message.
    pub message: String,
}

/// The HTTP status of an error class.
pub fn status_of(class: ErrorClass) -> StatusCode {
    match class {
        ErrorClass::NotFound => StatusCode::NOT_FOUND,
        ErrorClass::Invalid => StatusCode::BAD_REQUEST,
        ErrorClass::Conflict => StatusCode::CONFLICT,
        ErrorClass::Capacity => StatusCode::TOO_MANY_REQUESTS,
        ErrorClass::Timeout => StatusCode::GATEWAY_TIMEOUT,
        ErrorClass::Guest => StatusCode::UNPROCESSABLE_ENTITY,
        ErrorClass::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        ErrorClass::Internal => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

impl ApiError {
    /// An error with this status, code and message.
    pub fn new(
        status: StatusCode,
        code: impl Into<Cow<'static, str>>,
        message: impl Into<String>,
    ) -> Self {
        ApiError {
            status,
            code: code.into(),
            message: message.into(),
        }
    }

    /// 400 `invalid_request`.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request", message)
    }

    /// 413 `body_too_large`.
    pub fn too_large(limit: u64) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            format!("the request body is over the limit of {limit} bytes"),
        )
    }

    /// 500 `internal`.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
    }

    /// The JSON body.
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                code: self.code.to_string(),
                message: self.message.clone(),
            },
        }
    }
}

impl From<RuntimeError> for ApiError {
    fn from(e: RuntimeError) -> Self {
        // A volume at its cap: 507, as WebDAV says of a full store.
        let status = if e.code() == "volume_full" {
            StatusCode::INSUFFICIENT_STORAGE
        } else {
            status_of(e.class())
        };
        ApiError::new(status, e.code(), e.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::error!(code = %self.code, "{}", self.message);
        }
        let body = serde_json::to_vec(&self.body()).unwrap_or_default();
        let mut resp = (self.status, body).into_response();
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        resp
    }
}

/// A JSON body: any content type, an empty body counts as `{}`; malformed JSON, wrong types
/// and unknown fields are 400 `invalid_request`, more than [`MAX_JSON_BYTES`] is 413.
#[derive(Debug, Clone)]
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, _state: &S) -> Result<Self, Self::Rejection> {
        let bytes = read_body(req.into_body(), MAX_JSON_BYTES).await?;
        let text: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) {
            b"{}"
        } else {
            &bytes
        };
        serde_json::from_slice(text)
            .map(ApiJson)
            .map_err(|e| ApiError::invalid(format!("invalid JSON body: {e}")))
    }
}

/// Reads a whole (small) body, at most `limit` bytes.
async fn read_body(body: Body, limit: usize) -> Result<Vec<u8>, ApiError> {
    let mut out = Vec::new();
    let mut stream = body.into_data_stream();
    while let Some(chunk) = stream.next().await {
        let chunk =
            chunk.map_err(|e| ApiError::invalid(format!("cannot read the request body: {e}")))?;
        if out.len() + chunk.len() > limit {
            return Err(ApiError::too_large(limit as u64));
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out)
}

/// A query string; a malformed one, or one with unknown parameters, is 400
/// `invalid_request`.
#[derive(Debug, Clone)]
pub struct ApiQuery<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        axum::extract::Query::<T>::from_request_parts(parts, state)
            .await
            .map(|q| ApiQuery(q.0))
            .map_err(|e| ApiError::invalid(e.body_text()))
    }
}

/// The code of an error axum answered on its own, by status.
fn code_for(status: StatusCode) -> &'static str {
    match status {
        StatusCode::BAD_REQUEST
        | StatusCode::UNSUPPORTED_MEDIA_TYPE
        | StatusCode::UNPROCESSABLE_ENTITY => "invalid_request",
        StatusCode::UNAUTHORIZED => "unauthorized",
        StatusCode::NOT_FOUND => "route_not_found",
        StatusCode::METHOD_NOT_ALLOWED => "method_not_allowed",
        StatusCode::PAYLOAD_TOO_LARGE => "body_too_large",
        s if s.is_server_error() => "internal",
        _ => "error",
    }
}

/// Rewrites an error response that is not JSON (axum's own rejections) into the API's
/// error shape, keeping its status, headers (`Allow`) and text. `method` and `path` are the
/// request's, for the message of an empty 404 or 405.
pub async fn jsonify(resp: Response, method: &str, path: &str) -> Response {
    let status = resp.status();
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let text = read_body(body, 16 << 10).await.unwrap_or_default();
    let mut message = String::from_utf8_lossy(&text).trim().to_string();
    if message.is_empty() && status == StatusCode::METHOD_NOT_ALLOWED {
        message = format!("{method} is not allowed on {path}");
    } else if message.is_empty() && status == StatusCode::NOT_FOUND {
        message = format!("no route {method} {path}");
    } else if message.is_empty() {
        message = status
            .canonical_reason()
            .unwrap_or("request failed")
            .to_string();
    }
    let mut out = ApiError::new(status, code_for(status), message).into_response();
    for (k, v) in parts.headers.iter() {
        if k != header::CONTENT_TYPE && k != header::CONTENT_LENGTH {
            out.headers_mut().insert(k.clone(), v.clone());
        }
    }
    out
}

/// Unknown routes: 404 `route_not_found`.
pub async fn no_route(req: Request) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "route_not_found",
        format!("no route {} {}", req.method(), req.uri().path()),
    )
}
