//! Which requests on the server's one listener belong to the E2B surface, and where they go.
//!
//! - **Sandbox traffic** carries `E2b-Sandbox-Id` (and `E2b-Sandbox-Port`, default 49983),
//!   or comes for `Host: <port>-<id>.<domain>` with the configured domain (ports ignored on
//!   both sides). Port 49983 is envd (`/health`, `/files`, `/envs`, Connect RPC), 49999 the
//!   code interpreter; any other port is "not open" (502). A sandbox that does not exist or
//!   has ended is 502 "The sandbox <id> was not found", which the SDKs read as "not
//!   running". Every request but `GET /health` must carry the sandbox's access token:
//!   `X-Access-Token` (envd, `/execute`) or `E2B-Traffic-Access-Token` (code interpreter).
//! - **Control plane**: `Host: api.<domain>`, or a path under `/sandboxes`,
//!   `/v2/sandboxes`, `/snapshots` or `/templates`; authenticated by `X-API-KEY` (the
//!   server's token).
//! - Everything else is the native API, unchanged (bearer token, `/v1/...`).

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use ember_runtime::call::{self, Io};

pub use super::target::{gone_or, Target};
use super::Surface;
use super::{control, envd, interp, E2bError, E2bRoute, E2bState, ENVD_PORT, INTERP_PORT};
use ember_runtime::State as SandboxState;

/// Where a request goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Traffic {
    /// The native API.
    Native,
    /// The E2B control plane.
    Control,
    /// A sandbox's port.
    Sandbox {
        /// The sandbox id.
        id: String,
        /// The port in the sandbox.
        port: u16,
    },
}

/// `host` without its port (`[::1]:3000` → `[::1]`), lower-cased.
fn strip_port(host: &str) -> String {
    let h = host.trim();
    let h = if h.starts_with('[') {
        h.split_once(']')
            .map_or(h, |(a, _)| a)
            .trim_start_matches('[')
    } else {
        h.rsplit_once(':')
            .filter(|(_, p)| p.bytes().all(|c| c.is_ascii_digit()))
            .map_or(h, |(a, _)| a)
    };
    h.trim_end_matches('.').to_ascii_lowercase()
}

/// Whether `id` looks like a sandbox id (so that it can go in paths and messages).
fn sane_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_')
}

fn is_under(path: &str, prefix: &str) -> bool {
    path == prefix
        || path
            .strip_prefix(prefix)
            .is_some_and(|rest| rest.starts_with('/'))
}

/// Classifies a request (see the module docs). A sandbox header with a malformed id or
/// port is a 400.
pub fn classify(domain: Option<&str>, headers: &HeaderMap, uri: &Uri) -> Result<Traffic, E2bError> {
    if let Some(v) = headers.get("e2b-sandbox-id") {
        let id = v
            .to_str()
            .ok()
            .map(str::trim)
            .filter(|s| sane_id(s))
            .ok_or_else(|| E2bError::invalid("E2b-Sandbox-Id: not a sandbox id"))?;
        let port = match headers.get("e2b-sandbox-port") {
            None => ENVD_PORT,
            Some(p) => p
                .to_str()
                .ok()
                .and_then(|p| p.trim().parse().ok())
                .ok_or_else(|| E2bError::invalid("E2b-Sandbox-Port: not a port number"))?,
        };
        return Ok(Traffic::Sandbox {
            id: id.to_string(),
            port,
        });
    }
    let host = uri
        .authority()
        .map(|a| a.as_str().to_string())
        .or_else(|| {
            headers
                .get(header::HOST)
                .and_then(|h| h.to_str().ok())
                .map(str::to_string)
        })
        .map(|h| strip_port(&h));
    if let (Some(host), Some(domain)) = (host, domain) {
        let domain = strip_port(domain);
        if !domain.is_empty() {
            if host == format!("api.{domain}") {
                return Ok(Traffic::Control);
            }
            if let Some(label) = host
                .strip_suffix(domain.as_str())
                .and_then(|l| l.strip_suffix('.'))
                .filter(|l| !l.contains('.'))
            {
                if let Some((port, id)) = label.split_once('-') {
                    if let (Ok(port), true) = (port.parse::<u16>(), sane_id(id)) {
                        return Ok(Traffic::Sandbox {
                            id: id.to_string(),
                            port,
                        });
                    }
                }
            }
        }
    }
    let path = uri.path();
    if [
        "/sandboxes",
        "/v2/sandboxes",
        "/snapshots",
        "/templates",
        "/v2/templates",
        "/v3/templates",
        "/secrets",
        "/volumes",
        "/volumecontent",
    ]
    .iter()
    .any(|p| is_under(path, p))
    {
        return Ok(Traffic::Control);
    }
    Ok(Traffic::Native)
}

/// The outer middleware: E2B traffic is answered here (by the surface's routers, built once
/// with the server's), the rest goes on to the native API.
pub async fn dispatch(State(surface): State<Surface>, req: Request, next: Next) -> Response {
    let st = surface.st.clone();
    let traffic = classify(st.opts.domain.as_deref(), req.headers(), req.uri());
    let (label, mut resp) = match traffic {
        Ok(Traffic::Native) => return next.run(req).await,
        Ok(Traffic::Control) => (
            "e2b:control",
            control::handle(&st, &surface.control, req).await,
        ),
        Ok(Traffic::Sandbox { id, port }) => {
            let label = match port {
                ENVD_PORT => "e2b:envd",
                INTERP_PORT => "e2b:interpreter",
                _ => "e2b:port",
            };
            (label, sandbox(&surface, id, port, req).await)
        }
        Err(e) => ("e2b:invalid", e.into_response()),
    };
    resp.extensions_mut().insert(E2bRoute(label));
    resp
}

fn header_is(headers: &HeaderMap, name: &str, want: &str) -> bool {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| crate::same(v.trim().as_bytes(), want.as_bytes()))
}

/// Whether the request carries the sandbox's token for `port` (or, for `/files`, a valid
/// signature).
pub fn authorized(
    st: &E2bState,
    id: &str,
    port: u16,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
) -> bool {
    let envd = st.envd_token(id);
    if header_is(headers, "x-access-token", &envd) {
        return true;
    }
    if port == INTERP_PORT {
        return header_is(headers, "e2b-traffic-access-token", &st.traffic_token(id));
    }
    uri.path() == "/files" && signed(&envd, method, uri, ember_runtime::clock::now_ms() / 1000)
}

/// The signature of a `/files` URL (`e2b/sandbox/signature.py`): `v1_` + base64 (no
/// padding) of SHA-256 of `<path>:<read|write>:<username or "">:<token>[:<expiration>]`.
pub fn file_signature(path: &str, op: &str, user: &str, token: &str, exp: Option<&str>) -> String {
    use sha2::{Digest, Sha256};
    let raw = match exp {
        None => format!("{path}:{op}:{user}:{token}"),
        Some(e) => format!("{path}:{op}:{user}:{token}:{e}"),
    };
    let digest = Sha256::digest(raw.as_bytes());
    format!(
        "v1_{}",
        base64::Engine::encode(&base64::engine::general_purpose::STANDARD_NO_PAD, digest)
    )
}

/// Whether a `/files` request carries a valid, unexpired signature (`now`: Unix seconds).
fn signed(token: &str, method: &Method, uri: &Uri, now: i64) -> bool {
    let Ok(axum::extract::Query(q)) =
        axum::extract::Query::<std::collections::HashMap<String, String>>::try_from_uri(uri)
    else {
        return false;
    };
    let op = match *method {
        Method::GET => "read",
        Method::POST => "write",
        _ => return false,
    };
    let (Some(sig), Some(path)) = (q.get("signature"), q.get("path")) else {
        return false;
    };
    let exp = q.get("signature_expiration").map(String::as_str);
    if let Some(e) = exp {
        match e.parse::<i64>() {
            Ok(e) if e >= now => {}
            _ => return false,
        }
    }
    let user = q.get("username").map_or("", String::as_str);
    let want = file_signature(path, op, user, token, exp);
    crate::same(sig.as_bytes(), want.as_bytes())
}

/// Routes one request to sandbox `id`'s `port`.
async fn sandbox(surface: &Surface, id: String, port: u16, mut req: Request) -> Response {
    let st = surface.st.clone();
    let health = port == ENVD_PORT && req.uri().path() == "/health" && req.method() == Method::GET;
    let known_port = port == ENVD_PORT || port == INTERP_PORT;
    if known_port && !health && !authorized(&st, &id, port, req.method(), req.uri(), req.headers())
    {
        let which = if port == ENVD_PORT {
            "X-Access-Token"
        } else {
            "X-Access-Token or E2B-Traffic-Access-Token"
        };
        return E2bError::unauthorized(format!(
            "missing or wrong {which} for sandbox {id} (use the envdAccessToken / \
             trafficAccessToken the API returned)"
        ))
        .into_response();
    }
    let id2 = id.clone();
    let info = match st
        .app
        .call(move |b| {
            b.call(
                call::Get {
                    id: id2.to_string(),
                },
                Io::none(),
            )
        })
        .await
    {
        Ok(i) => i,
        Err(e) if e.status == StatusCode::NOT_FOUND => {
            return E2bError::sandbox_gone(&id).into_response()
        }
        Err(e) => return E2bError::from(e).into_response(),
    };
    let gone = info.state.is_final()
        // `is_running()` must say no for a paused sandbox; other calls resume it.
        || (health && matches!(info.state, SandboxState::Paused | SandboxState::Pausing));
    if gone {
        return E2bError::sandbox_gone(&id).into_response();
    }
    if !known_port {
        // A guest port (`get_host(port)`): exposed ports only, with the sandbox's token
        // unless exposed as public.
        let id2 = id.clone();
        let exposed = st
            .app
            .call(move |b| {
                b.call(
                    call::Exposed {
                        id: id2.to_string(),
                        port,
                    },
                    Io::none(),
                )
            })
            .await;
        let Ok(Some(exposed)) = exposed else {
            return E2bError::port_closed(&id, port).into_response();
        };
        let token_ok = header_is(
            req.headers(),
            "e2b-traffic-access-token",
            &st.traffic_token(&id),
        ) || header_is(req.headers(), "x-access-token", &st.traffic_token(&id))
            || header_is(req.headers(), "x-access-token", &st.envd_token(&id));
        if !exposed.public && !token_ok {
            return E2bError::unauthorized(format!(
                "port {port} of sandbox {id} is private: send E2B-Traffic-Access-Token (the \
                 trafficAccessToken) or expose it as public"
            ))
            .into_response();
        }
        let target = req
            .uri()
            .path_and_query()
            .map(|p| p.as_str().to_string())
            .unwrap_or_else(|| "/".into());
        return crate::ports::to_port(&st.app, &id, port, req, target, None).await;
    }
    req.extensions_mut().insert(Target {
        id: id.clone(),
        info,
    });
    if port == ENVD_PORT {
        envd::handle(st, &surface.envd, id, req).await
    } else {
        interp::handle(&surface.interp, req).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn hdrs(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    fn uri(s: &str) -> Uri {
        s.parse().unwrap()
    }

    #[test]
    fn sandbox_headers_route_to_the_sandbox_port() {
        let h = hdrs(&[("e2b-sandbox-id", "abc123"), ("e2b-sandbox-port", "49999")]);
        assert_eq!(
            classify(None, &h, &uri("/execute")).unwrap(),
            Traffic::Sandbox {
                id: "abc123".into(),
                port: 49999
            }
        );
        let h = hdrs(&[("e2b-sandbox-id", "abc123")]);
        assert_eq!(
            classify(None, &h, &uri("/v1/sandboxes")).unwrap(),
            Traffic::Sandbox {
                id: "abc123".into(),
                port: ENVD_PORT
            }
        );
        let h = hdrs(&[("e2b-sandbox-id", "a/b")]);
        assert_eq!(
            classify(None, &h, &uri("/")).unwrap_err().status,
            StatusCode::BAD_REQUEST
        );
        let h = hdrs(&[("e2b-sandbox-id", "ab"), ("e2b-sandbox-port", "x")]);
        assert!(classify(None, &h, &uri("/")).is_err());
    }

    #[test]
    fn hosts_route_by_domain_ignoring_ports() {
        let d = Some("e2b.localhost:3443");
        let h = hdrs(&[("host", "49983-abcd.e2b.localhost:3443")]);
        assert_eq!(
            classify(d, &h, &uri("/health")).unwrap(),
            Traffic::Sandbox {
                id: "abcd".into(),
                port: 49983
            }
        );
        let h = hdrs(&[("host", "49999-ABCD.E2B.localhost")]);
        assert_eq!(
            classify(d, &h, &uri("/execute")).unwrap(),
            Traffic::Sandbox {
                id: "abcd".into(),
                port: 49999
            }
        );
        // HTTP/2: the authority is in the URI.
        let h = HeaderMap::new();
        assert_eq!(
            classify(d, &h, &uri("https://8080-abcd.e2b.localhost:3443/x")).unwrap(),
            Traffic::Sandbox {
                id: "abcd".into(),
                port: 8080
            }
        );
        let h = hdrs(&[("host", "api.e2b.localhost:3443")]);
        assert_eq!(classify(d, &h, &uri("/health")).unwrap(), Traffic::Control);
        // Other hosts and deeper names are not sandboxes.
        for host in [
            "x.49983-abcd.e2b.localhost",
            "abcd.e2b.localhost",
            "127.0.0.1:3000",
        ] {
            let h = hdrs(&[("host", host)]);
            assert_eq!(
                classify(d, &h, &uri("/health")).unwrap(),
                Traffic::Native,
                "{host}"
            );
        }
        // Without a domain, hosts mean nothing.
        let h = hdrs(&[("host", "49983-abcd.e2b.localhost")]);
        assert_eq!(
            classify(None, &h, &uri("/health")).unwrap(),
            Traffic::Native
        );
    }

    #[test]
    fn control_plane_paths_and_native_paths() {
        let h = HeaderMap::new();
        for p in [
            "/sandboxes",
            "/sandboxes/x/pause",
            "/v2/sandboxes",
            "/v2/sandboxes/x/connect",
            "/snapshots",
            "/templates/x",
            "/secrets",
            "/secrets/openai",
            "/volumes",
            "/volumes/data",
            "/volumecontent/data/file",
        ] {
            assert_eq!(
                classify(None, &h, &uri(p)).unwrap(),
                Traffic::Control,
                "{p}"
            );
        }
        for p in ["/v1/sandboxes", "/healthz", "/sandboxesX", "/metrics", "/"] {
            assert_eq!(classify(None, &h, &uri(p)).unwrap(), Traffic::Native, "{p}");
        }
    }

    #[test]
    fn file_signatures_match_the_sdk() {
        // `get_signature("/home/user/a.txt", "read", None, "tok")` in the Python SDK.
        let sig = file_signature("/home/user/a.txt", "read", "", "tok", None);
        assert_eq!(sig, "v1_Zkbb3914oLJLvMBzCAHQhm2ydBLxbSx2eQUR/kLdvIY");
        let enc = |s: &str| s.replace('/', "%2F").replace('+', "%2B");
        let uri = |q: &str| format!("/files?{q}").parse::<Uri>().unwrap();
        let ok = uri(&format!(
            "path=%2Fhome%2Fuser%2Fa.txt&signature={}",
            enc(&sig)
        ));
        assert!(signed("tok", &Method::GET, &ok, 0));
        assert!(!signed("other", &Method::GET, &ok, 0));
        assert!(!signed("tok", &Method::POST, &ok, 0));
        let exp = file_signature("x", "write", "root", "tok", Some("100"));
        let u = uri(&format!(
            "path=x&username=root&signature={}&signature_expiration=100",
            enc(&exp)
        ));
        assert!(signed("tok", &Method::POST, &u, 99));
        assert!(!signed("tok", &Method::POST, &u, 101));
    }

    #[test]
    fn ports_are_stripped_from_hosts() {
        assert_eq!(strip_port("a.b:3000"), "a.b");
        assert_eq!(strip_port("[::1]:3000"), "::1");
        assert_eq!(strip_port("A.B."), "a.b");
        assert_eq!(strip_port("a.b"), "a.b");
    }
}
