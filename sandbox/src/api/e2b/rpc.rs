//! Connect RPC services of envd (port 49983): `process.Process` and `filesystem.Filesystem`,
//! JSON codec. (Being written.)

use axum::extract::Request;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use super::E2bState;

/// Per-server state of the RPC services: processes' configs and tags, watchers.
#[derive(Debug, Default)]
pub struct RpcState {}

/// Serves one Connect RPC (`POST /process.Process/<M>` or `/filesystem.Filesystem/<M>`) for
/// sandbox `id`; the caller has routed and authenticated the request.
pub async fn handle(st: E2bState, id: String, req: Request) -> Response {
    let _ = (st, id, req);
    (StatusCode::NOT_IMPLEMENTED, "not yet").into_response()
}
