//! Sandbox networking on the native API: the policy (read, change at run time), exposed
//! ports, and the reverse proxy that carries a caller's HTTP (and WebSocket) traffic to an
//! exposed guest port: `/v1/sandboxes/{id}/ports/{port}/…`. The E2B Host route
//! (`<port>-<id>.<domain>`) uses the same proxy ([`to_port`]).
//!
//! Proxy requests skip the server's bearer check and are authorized here: the server's
//! token (`Authorization: Bearer`), the sandbox's own token (`X-Access-Token` or
//! `E2B-Traffic-Access-Token`, as `GET …/network` shows it), or nothing when the port was
//! exposed with `public: true`. ember's credentials are removed before the request reaches
//! the guest.

use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderName, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use ember_runtime::call::{self, Io};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::error::{ApiError, ApiJson};
use super::proxy::{self, ProxyOptions};
use super::AppState;
use ember_runtime::{NetworkInfo, NetworkPolicy};

/// `POST /v1/sandboxes/{id}/ports`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExposeBody {
    /// The guest TCP port.
    pub port: u16,
    /// Reachable without a token.
    #[serde(default)]
    pub public: bool,
}

/// A sandbox's network as the API shows it.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct NetworkBody {
    /// Policy, ports, counters.
    #[serde(flatten)]
    pub info: NetworkInfo,
    /// The sandbox's token for its exposed ports (`X-Access-Token`).
    pub access_token: String,
    /// Where exposed port P is served: this prefix + P + `/`.
    pub ports_url: String,
}

/// The sandbox's own token (the E2B traffic token: one secret per sandbox, derived).
pub fn access_token(st: &AppState, id: &str) -> String {
    crate::tokens::derive_token(&st.inner.token, "traffic-access", id)
}

fn body(st: &AppState, id: &str, info: NetworkInfo) -> Json<NetworkBody> {
    Json(NetworkBody {
        info,
        access_token: access_token(st, id),
        ports_url: format!("/v1/sandboxes/{id}/ports/"),
    })
}

/// A sandbox's network policy, exposed ports and counters (refused connections, refused
/// names, resolved addresses).
#[utoipa::path(get, path = "/v1/sandboxes/{id}/network", tag = "network",
    params(("id" = String, Path)),
    responses((status = 200, body = NetworkBody), (status = 404, body = super::types::ErrorBody)))]
pub async fn get_network(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<NetworkBody>, ApiError> {
    let id2 = id.clone();
    let info = st
        .call(move |b| {
            b.call(
                call::GetNetwork {
                    id: id2.to_string(),
                },
                Io::none(),
            )
        })
        .await?;
    Ok(body(&st, &id, info))
}

/// Changes the policy; a running sandbox gets it on its next connection.
#[utoipa::path(put, path = "/v1/sandboxes/{id}/network", tag = "network",
    params(("id" = String, Path)), request_body = NetworkPolicy,
    responses((status = 200, body = NetworkBody), (status = 400, body = super::types::ErrorBody)))]
pub async fn set_network(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiJson(policy): ApiJson<NetworkPolicy>,
) -> Result<Json<NetworkBody>, ApiError> {
    let id2 = id.clone();
    let info = st
        .call(move |b| {
            b.call(
                call::SetNetwork {
                    id: id2.to_string(),
                    policy: policy.clone(),
                },
                Io::none(),
            )
        })
        .await?;
    Ok(body(&st, &id, info))
}

/// Exposes a guest TCP port at `/v1/sandboxes/{id}/ports/{port}/`.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/ports", tag = "network",
    params(("id" = String, Path)), request_body = ExposeBody,
    responses((status = 200, body = NetworkBody), (status = 400, body = super::types::ErrorBody)))]
pub async fn expose(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<ExposeBody>,
) -> Result<Json<NetworkBody>, ApiError> {
    let id2 = id.clone();
    let info = st
        .call(move |b| {
            b.call(
                call::Expose {
                    id: id2.to_string(),
                    port: req.port,
                    public: req.public,
                },
                Io::none(),
            )
        })
        .await?;
    Ok(body(&st, &id, info))
}

/// Closes an exposed port.
#[utoipa::path(delete, path = "/v1/sandboxes/{id}/ports/{port}", tag = "network",
    params(("id" = String, Path), ("port" = u16, Path)),
    responses((status = 200, body = NetworkBody), (status = 404, body = super::types::ErrorBody)))]
pub async fn unexpose(
    State(st): State<AppState>,
    Path((id, port)): Path<(String, u16)>,
) -> Result<Json<NetworkBody>, ApiError> {
    let id2 = id.clone();
    let info = st
        .call(move |b| {
            b.call(
                call::Unexpose {
                    id: id2.to_string(),
                    port,
                },
                Io::none(),
            )
        })
        .await?;
    Ok(body(&st, &id, info))
}

/// Whether `path` is a proxy path (`/v1/sandboxes/{id}/ports/{port}` and below): the
/// server's bearer check leaves those to [`authorized`].
pub fn is_proxy_path(path: &str) -> bool {
    let Some(rest) = path.strip_prefix("/v1/sandboxes/") else {
        return false;
    };
    let mut parts = rest.splitn(4, '/');
    let (Some(id), Some("ports"), Some(port)) = (parts.next(), parts.next(), parts.next()) else {
        return false;
    };
    !id.is_empty() && !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit())
}

fn header_is(headers: &HeaderMap, name: &str, want: &str) -> bool {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| super::same(v.trim().as_bytes(), want.as_bytes()))
}

/// Whether the request carries the server's token or the sandbox's.
pub fn authorized(st: &AppState, id: &str, headers: &HeaderMap) -> bool {
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, token) = v.trim().split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
        });
    if bearer.is_some_and(|t| super::same(t.as_bytes(), st.inner.token.as_bytes())) {
        return true;
    }
    let own = access_token(st, id);
    header_is(headers, "x-access-token", &own)
        || header_is(headers, "e2b-traffic-access-token", &own)
}

fn bad_gateway(status: StatusCode, message: String) -> Response {
    (status, Json(serde_json::json!({ "error": message }))).into_response()
}

/// Proxies `req` to guest `port` of sandbox `id` (the caller checked access), sending
/// `path_and_query` as the target. `prefix`: the path prefix that was stripped.
pub async fn to_port(
    st: &AppState,
    id: &str,
    port: u16,
    req: Request,
    path_and_query: String,
    prefix: Option<String>,
) -> Response {
    let id2 = id.to_string();
    let stream = match st.call(move |b| b.connect_port(&id2, port, false)).await {
        Ok(s) => s,
        Err(e) if e.status == StatusCode::NOT_FOUND || e.status == StatusCode::CONFLICT => {
            return e.into_response()
        }
        Err(e) => {
            return bad_gateway(
                StatusCode::BAD_GATEWAY,
                format!("the sandbox's port {port} is not reachable: {}", e.message),
            )
        }
    };
    let stream = match tokio::net::TcpStream::from_std(stream) {
        Ok(s) => s,
        Err(e) => return bad_gateway(StatusCode::BAD_GATEWAY, e.to_string()),
    };
    let forwarded_for = req
        .extensions()
        .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
        .map(|c| c.0.ip());
    let opts = ProxyOptions {
        forwarded_for,
        prefix,
        strip_headers: vec![
            header::AUTHORIZATION,
            HeaderName::from_static("x-access-token"),
            HeaderName::from_static("e2b-traffic-access-token"),
        ],
        ..ProxyOptions::default()
    };
    proxy::forward(
        req,
        stream,
        &path_and_query,
        &format!("localhost:{port}"),
        &opts,
    )
    .await
}

async fn proxy_to(st: AppState, id: String, port: u16, rest: &str, req: Request) -> Response {
    let exposed = {
        let id2 = id.clone();
        st.call(move |b| {
            b.call(
                call::Exposed {
                    id: id2.to_string(),
                    port,
                },
                Io::none(),
            )
        })
        .await
    };
    let exposed = match exposed {
        Ok(Some(p)) => p,
        Ok(None) => {
            return ApiError::new(
                StatusCode::NOT_FOUND,
                "port_not_exposed",
                format!(
                    "port {port} of sandbox {id} is not exposed (POST /v1/sandboxes/{id}/ports)"
                ),
            )
            .into_response()
        }
        Err(e) => return e.into_response(),
    };
    if !exposed.public && !authorized(&st, &id, req.headers()) {
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            format!(
                "port {port} of sandbox {id} is private: send the server's bearer token or the \
                 sandbox's X-Access-Token (GET /v1/sandboxes/{id}/network), or expose it with \
                 public: true"
            ),
        )
        .into_response();
    }
    let query = req
        .uri()
        .query()
        .map(|q| format!("?{q}"))
        .unwrap_or_default();
    let target = format!("/{rest}{query}");
    let prefix = format!("/v1/sandboxes/{id}/ports/{port}");
    to_port(&st, &id, port, req, target, Some(prefix)).await
}

/// The reverse proxy: `ANY /v1/sandboxes/{id}/ports/{port}/{*rest}` (WebSocket upgrades
/// included) to the guest's `port`, with the prefix stripped.
pub async fn proxy_rest(
    State(st): State<AppState>,
    Path((id, port, rest)): Path<(String, u16, String)>,
    req: Request,
) -> Response {
    proxy_to(st, id, port, &rest, req).await
}

/// `ANY /v1/sandboxes/{id}/ports/{port}/` (the root of the guest's server).
pub async fn proxy_root(
    State(st): State<AppState>,
    Path((id, port)): Path<(String, u16)>,
    req: Request,
) -> Response {
    proxy_to(st, id, port, "", req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proxy_paths_are_recognised() {
        assert!(is_proxy_path("/v1/sandboxes/abc/ports/8080"));
        assert!(is_proxy_path("/v1/sandboxes/abc/ports/8080/"));
        assert!(is_proxy_path("/v1/sandboxes/abc/ports/8080/x/y?z"));
        assert!(!is_proxy_path("/v1/sandboxes/abc/ports"));
        assert!(!is_proxy_path("/v1/sandboxes/abc/ports/"));
        assert!(!is_proxy_path("/v1/sandboxes/abc/ports/x1"));
        assert!(!is_proxy_path("/v1/sandboxes/abc/network"));
        assert!(!is_proxy_path("/v1/sandboxes//ports/1"));
    }
}
