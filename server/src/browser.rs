//! The browser sandbox's routes (issue 15; reference: `docs/browser.md`).
//!
//! A sandbox of the `browser` template has headless Chromium running since its template's
//! snapshot, with its DevTools endpoint relayed to guest port [`CDP_PORT`]. That port is
//! reachable only from inside the sandbox's network namespace (every sandbox has its own; the
//! host and other sandboxes have no route to it), so the only way in is through these routes,
//! which open the connection from inside the namespace like the exposed-ports proxy does:
//!
//! - `GET /v1/sandboxes/{id}/cdp` (also `…/cdp/json/version`): Chromium's `/json/version`,
//!   with `webSocketDebuggerUrl` pointing back at this server. `connect_over_cdp(url)`
//!   (Playwright) fetches `…/cdp/json/version/`; `puppeteer.connect({browserWSEndpoint})`
//!   takes the URL itself.
//! - `GET /v1/sandboxes/{id}/cdp/json/list` (also `…/cdp/json`): the targets, URLs rewritten.
//! - `GET /v1/sandboxes/{id}/cdp/devtools/{*rest}`: the DevTools WebSocket (spliced).
//! - `GET /v1/sandboxes/{id}/view`: a live view page (screencast frames, clicks and keys).
//! - `GET /v1/sandboxes/{id}/screenshot`: a PNG of the page (`?target=ID`, `?full_page=true`).
//!
//! Access: the server's bearer token, the sandbox's own token (`X-Access-Token`, as `GET
//! …/network` shows it) or `?token=<the sandbox's token>` — the WebSocket URLs this module
//! hands out carry the last form, so that CDP clients that cannot send headers work. The
//! token is removed before the request reaches the guest, and so is `Origin`: Chromium refuses
//! DevTools WebSockets with an `Origin` it was not told to allow, and the browser keeps that
//! default so that pages it loads cannot drive their own DevTools. Chromium also refuses Host
//! headers that are not an IP address or `localhost`: the guest always sees `localhost`.

// The handlers' helpers fail with the ready HTTP answer (`Result<_, Response>`), as axum
// handlers do; boxing it would buy nothing on these paths.
#![allow(clippy::result_large_err)]

use std::time::Duration;

use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use base64::Engine;
use serde::Deserialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::error::ApiError;
use super::proxy::{self, ProxyOptions};
use super::{ports, AppState};

/// The guest port the browser's DevTools endpoint is relayed to (the `browser` template's
/// `socat` service; Chromium itself listens on 127.0.0.1 in the guest).
pub const CDP_PORT: u16 = 9222;

/// Largest DevTools HTTP answer read (`/json/list` with many targets).
const MAX_JSON: usize = 4 << 20;
/// Largest screenshot frame accepted from the guest (base64 of the PNG).
const MAX_FRAME: usize = 64 << 20;
/// How long a DevTools HTTP request may take.
const GUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a screenshot may take: the page's first capture after a restore renders and
/// encodes in a guest whose kernel work is emulated on kvm_pvm hosts (measured there: ~30 s
/// for the first `Page.captureScreenshot` of a freshly restored sandbox).
const SCREENSHOT_TIMEOUT: Duration = Duration::from_secs(180);

/// The routes, added to the server's router (their access is checked here, see
/// [`is_browser_path`]).
pub fn routes(router: Router<AppState>) -> Router<AppState> {
    router
        .route("/v1/sandboxes/{id}/cdp", get(version))
        .route("/v1/sandboxes/{id}/cdp/", get(version))
        .route("/v1/sandboxes/{id}/cdp/json/version", get(version))
        .route("/v1/sandboxes/{id}/cdp/json/version/", get(version))
        .route("/v1/sandboxes/{id}/cdp/json", get(list))
        .route("/v1/sandboxes/{id}/cdp/json/", get(list))
        .route("/v1/sandboxes/{id}/cdp/json/list", get(list))
        .route("/v1/sandboxes/{id}/cdp/json/list/", get(list))
        .route("/v1/sandboxes/{id}/cdp/devtools/{*rest}", get(devtools))
        .route("/v1/sandboxes/{id}/view", get(view))
        .route("/v1/sandboxes/{id}/screenshot", get(screenshot))
}

/// Whether `path` is one of these routes: the server's bearer check leaves them to
/// [`authorize`] (which also takes the sandbox's token).
pub fn is_browser_path(path: &str) -> bool {
    let Some(rest) = path.strip_prefix("/v1/sandboxes/") else {
        return false;
    };
    let Some((id, tail)) = rest.split_once('/') else {
        return false;
    };
    !id.is_empty()
        && (tail == "cdp" || tail.starts_with("cdp/") || tail == "view" || tail == "screenshot")
}

/// `?token=` and the screenshot's options.
#[derive(Debug, Default, Deserialize)]
pub struct BrowserQuery {
    /// The sandbox's access token (instead of a header).
    #[serde(default)]
    token: Option<String>,
    /// Screenshot: the page target (default: the first page `/json/list` shows).
    #[serde(default)]
    target: Option<String>,
    /// Screenshot: the whole page rather than the viewport.
    #[serde(default)]
    full_page: Option<bool>,
}

fn authorize(
    st: &AppState,
    id: &str,
    headers: &HeaderMap,
    q: &BrowserQuery,
) -> Result<(), Response> {
    if ports::authorized(st, id, headers) {
        return Ok(());
    }
    let own = ports::access_token(st, id);
    if q.token
        .as_deref()
        .is_some_and(|t| super::same(t.as_bytes(), own.as_bytes()))
    {
        return Ok(());
    }
    Err(ApiError::new(
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        format!(
            "the browser of sandbox {id} needs the server's bearer token, the sandbox's \
             X-Access-Token or ?token= (GET /v1/sandboxes/{id}/network shows it)"
        ),
    )
    .into_response())
}

/// Opens a connection to the guest's DevTools relay from inside the sandbox's namespace.
async fn connect(st: &AppState, id: &str) -> Result<TcpStream, Response> {
    let id2 = id.to_string();
    match st
        .call(move |b| b.connect_port(&id2, CDP_PORT, false))
        .await
    {
        // tokio needs the socket non-blocking (whatever the backend handed over).
        Ok(s) => s
            .set_nonblocking(true)
            .and_then(|()| TcpStream::from_std(s))
            .map_err(|e| gateway(StatusCode::BAD_GATEWAY, e.to_string())),
        Err(e) if e.status == StatusCode::NOT_FOUND || e.status == StatusCode::CONFLICT => {
            Err(e.into_response())
        }
        Err(e) if e.status == StatusCode::BAD_REQUEST => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "no_browser",
            format!("sandbox {id} has no browser: {}", e.message),
        )
        .into_response()),
        Err(e) => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "no_browser",
            format!(
                "sandbox {id} has no browser answering on guest port {CDP_PORT} (is it a \
                 `browser` template sandbox?): {}",
                e.message
            ),
        )
        .into_response()),
    }
}

fn gateway(status: StatusCode, message: String) -> Response {
    ApiError::new(status, "browser_unreachable", message).into_response()
}

/// `GET path` on the guest's DevTools HTTP endpoint: the JSON body.
async fn guest_json(st: &AppState, id: &str, path: &str) -> Result<serde_json::Value, Response> {
    let mut stream = connect(st, id).await?;
    let fetch = async {
        let req = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
        stream.write_all(req.as_bytes()).await?;
        let mut buf = Vec::new();
        let mut chunk = [0u8; 16 << 10];
        loop {
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                break;
            }
            buf.extend_from_slice(&chunk[..n]);
            if buf.len() > MAX_JSON {
                return Err(std::io::Error::other("the answer is too large"));
            }
            if let Some(body) = complete_body(&buf) {
                return Ok(body.to_vec());
            }
        }
        complete_body(&buf)
            .map(<[u8]>::to_vec)
            .ok_or_else(|| std::io::Error::other("the answer ended early"))
    };
    let body = match tokio::time::timeout(GUEST_TIMEOUT, fetch).await {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => {
            return Err(gateway(
                StatusCode::BAD_GATEWAY,
                format!("the browser of sandbox {id} did not answer {path}: {e}"),
            ))
        }
        Err(_) => {
            return Err(gateway(
                StatusCode::GATEWAY_TIMEOUT,
                format!(
                    "the browser of sandbox {id} did not answer {path} within {GUEST_TIMEOUT:?}"
                ),
            ))
        }
    };
    serde_json::from_slice(&body).map_err(|e| {
        gateway(
            StatusCode::BAD_GATEWAY,
            format!("the browser of sandbox {id} answered {path} with something not JSON: {e}"),
        )
    })
}

/// The body of a complete `200` HTTP/1.x answer in `buf` (by `Content-Length`, or up to
/// the end when it has none), or None while it is incomplete or not a `200`.
fn complete_body(buf: &[u8]) -> Option<&[u8]> {
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&buf[..end]).ok()?;
    let body = &buf[end + 4..];
    let mut lines = head.split("\r\n");
    let status = lines.next()?;
    if status.split_whitespace().nth(1) != Some("200") {
        return None;
    }
    let length = lines.find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim()
            .eq_ignore_ascii_case("content-length")
            .then(|| v.trim().parse::<usize>().ok())
            .flatten()
    });
    match length {
        Some(n) if body.len() >= n => Some(&body[..n]),
        Some(_) => None,
        None => Some(body),
    }
}

/// How the caller reached this server: `ws`/`wss` and the Host it used.
fn public_base(headers: &HeaderMap, req_scheme: Option<&str>) -> (String, String) {
    let https = req_scheme == Some("https")
        || headers
            .get("x-forwarded-proto")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.eq_ignore_ascii_case("https"));
    let host = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .filter(|h| !h.is_empty() && h.bytes().all(|b| b.is_ascii_graphic()))
        .unwrap_or("127.0.0.1:7070")
        .to_string();
    (if https { "wss" } else { "ws" }.to_string(), host)
}

/// Rewrites a guest DevTools WebSocket URL (`ws://localhost/devtools/page/ID`) into this
/// server's route for it, carrying the sandbox's token.
fn rewrite_ws(url: &str, scheme: &str, host: &str, id: &str, token: &str) -> Option<String> {
    let at = url.find("/devtools/")?;
    let rest = &url[at + "/devtools/".len()..];
    Some(format!(
        "{scheme}://{host}/v1/sandboxes/{id}/cdp/devtools/{rest}?token={token}"
    ))
}

fn rewrite_target(t: &mut serde_json::Value, scheme: &str, host: &str, id: &str, token: &str) {
    let Some(obj) = t.as_object_mut() else {
        return;
    };
    if let Some(url) = obj.get("webSocketDebuggerUrl").and_then(|u| u.as_str()) {
        match rewrite_ws(url, scheme, host, id, token) {
            Some(new) => {
                obj.insert("webSocketDebuggerUrl".into(), new.into());
            }
            None => {
                obj.remove("webSocketDebuggerUrl");
            }
        }
    }
    // It points at Google's DevTools front-end with the guest's address; useless here.
    obj.remove("devtoolsFrontendUrl");
    obj.remove("devtoolsFrontendUrlCompat");
}

/// `GET …/cdp` and `…/cdp/json/version`: Chromium's `/json/version`, rewritten.
async fn version(
    State(st): State<AppState>,
    Path(id): Path<String>,
    Query(q): Query<BrowserQuery>,
    req: Request,
) -> Response {
    if let Err(r) = authorize(&st, &id, req.headers(), &q) {
        return r;
    }
    let mut v = match guest_json(&st, &id, "/json/version").await {
        Ok(v) => v,
        Err(r) => return r,
    };
    let (scheme, host) = public_base(req.headers(), req.uri().scheme_str());
    let token = ports::access_token(&st, &id);
    rewrite_target(&mut v, &scheme, &host, &id, &token);
    Json(v).into_response()
}

/// `GET …/cdp/json/list` and `…/cdp/json`: the targets, rewritten.
async fn list(
    State(st): State<AppState>,
    Path(id): Path<String>,
    Query(q): Query<BrowserQuery>,
    req: Request,
) -> Response {
    if let Err(r) = authorize(&st, &id, req.headers(), &q) {
        return r;
    }
    let mut v = match guest_json(&st, &id, "/json/list").await {
        Ok(v) => v,
        Err(r) => return r,
    };
    let (scheme, host) = public_base(req.headers(), req.uri().scheme_str());
    let token = ports::access_token(&st, &id);
    if let Some(targets) = v.as_array_mut() {
        for t in targets {
            rewrite_target(t, &scheme, &host, &id, &token);
        }
    }
    Json(v).into_response()
}

/// `GET …/cdp/devtools/{*rest}`: the DevTools WebSocket, spliced to the guest.
async fn devtools(
    State(st): State<AppState>,
    Path((id, rest)): Path<(String, String)>,
    Query(q): Query<BrowserQuery>,
    req: Request,
) -> Response {
    if let Err(r) = authorize(&st, &id, req.headers(), &q) {
        return r;
    }
    if !rest
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'/' || b == b'-' || b == b'_' || b == b'.')
    {
        return ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad_target",
            format!("{rest:?} is not a DevTools target path"),
        )
        .into_response();
    }
    let stream = match connect(&st, &id).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let forwarded_for = req
        .extensions()
        .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
        .map(|c| c.0.ip());
    let opts = ProxyOptions {
        forwarded_for,
        prefix: None,
        strip_headers: vec![
            header::AUTHORIZATION,
            header::ORIGIN,
            HeaderName::from_static("x-access-token"),
            HeaderName::from_static("e2b-traffic-access-token"),
        ],
        // A CDP session stays open as long as its client wants; only the head is timed.
        ..ProxyOptions::default()
    };
    // The query (the token) stays here.
    proxy::forward(
        req,
        stream,
        &format!("/devtools/{rest}"),
        "localhost",
        &opts,
    )
    .await
}

/// `GET …/view`: the live view page.
async fn view(
    State(st): State<AppState>,
    Path(id): Path<String>,
    Query(q): Query<BrowserQuery>,
    headers: HeaderMap,
) -> Response {
    if let Err(r) = authorize(&st, &id, &headers, &q) {
        return r;
    }
    // The page calls back with the sandbox's token (never the server's).
    let token = ports::access_token(&st, &id);
    let html = VIEW_HTML
        .replace("{{ID_JSON}}", &json_for_script(&id))
        .replace("{{TOKEN_JSON}}", &json_for_script(&token))
        .replace("{{ID_HTML}}", &html_escape(&id));
    let mut resp = (StatusCode::OK, html).into_response();
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    resp
}

/// A JSON string literal safe inside a `<script>` element.
fn json_for_script(s: &str) -> String {
    serde_json::Value::from(s)
        .to_string()
        .replace('<', "\\u003c")
        .replace('>', "\\u003e")
        .replace('&', "\\u0026")
}

fn html_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// `GET …/screenshot`: a PNG of a page of the sandbox's browser.
async fn screenshot(
    State(st): State<AppState>,
    Path(id): Path<String>,
    Query(q): Query<BrowserQuery>,
    headers: HeaderMap,
) -> Response {
    if let Err(r) = authorize(&st, &id, &headers, &q) {
        return r;
    }
    match capture(&st, &id, q.target.as_deref(), q.full_page.unwrap_or(false)).await {
        Ok(png) => {
            let mut resp = (StatusCode::OK, png).into_response();
            resp.headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static("image/png"));
            resp
        }
        Err(r) => r,
    }
}

/// Takes a PNG screenshot of page `target` (default: the first page target).
pub(crate) async fn capture(
    st: &AppState,
    id: &str,
    target: Option<&str>,
    full_page: bool,
) -> Result<Vec<u8>, Response> {
    let targets = guest_json(st, id, "/json/list").await?;
    let page = targets
        .as_array()
        .into_iter()
        .flatten()
        .filter(|t| t["type"] == "page")
        .find(|t| target.is_none_or(|want| t["id"] == want))
        .and_then(|t| t["id"].as_str().map(str::to_owned));
    let Some(page) = page else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "no_page",
            match target {
                Some(t) => format!("sandbox {id}'s browser has no page target {t:?}"),
                None => format!("sandbox {id}'s browser has no page open"),
            },
        )
        .into_response());
    };
    if !page.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
        return Err(gateway(
            StatusCode::BAD_GATEWAY,
            format!("the browser of sandbox {id} named a page {page:?}"),
        ));
    }
    let stream = connect(st, id).await?;
    let shot = async move {
        use futures_util::{SinkExt, StreamExt};
        use tokio_tungstenite::tungstenite::protocol::{Message, WebSocketConfig};
        let mut config = WebSocketConfig::default();
        config.max_message_size = Some(MAX_FRAME);
        config.max_frame_size = Some(MAX_FRAME);
        let (mut ws, _) = tokio_tungstenite::client_async_with_config(
            format!("ws://localhost/devtools/page/{page}"),
            stream,
            Some(config),
        )
        .await
        .map_err(|e| format!("WebSocket: {e}"))?;
        let mut params = serde_json::json!({ "format": "png" });
        if full_page {
            params["captureBeyondViewport"] = true.into();
        }
        let call =
            serde_json::json!({ "id": 1, "method": "Page.captureScreenshot", "params": params });
        ws.send(Message::text(call.to_string()))
            .await
            .map_err(|e| format!("WebSocket: {e}"))?;
        while let Some(msg) = ws.next().await {
            let text = match msg.map_err(|e| format!("WebSocket: {e}"))? {
                Message::Text(t) => t,
                Message::Close(_) => break,
                _ => continue,
            };
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| format!("not JSON: {e}"))?;
            if v["id"] != 1 {
                continue;
            }
            if let Some(err) = v.get("error") {
                return Err(format!("Page.captureScreenshot failed: {err}"));
            }
            let data = v["result"]["data"]
                .as_str()
                .ok_or("Page.captureScreenshot returned no data")?;
            let _ = ws.close(None).await;
            return base64::engine::general_purpose::STANDARD
                .decode(data)
                .map_err(|e| format!("the screenshot is not base64: {e}"));
        }
        Err("the DevTools connection closed before the screenshot".to_string())
    };
    match tokio::time::timeout(SCREENSHOT_TIMEOUT, shot).await {
        Ok(Ok(png)) => Ok(png),
        Ok(Err(e)) => Err(gateway(
            StatusCode::BAD_GATEWAY,
            format!("screenshot of sandbox {id}'s browser: {e}"),
        )),
        Err(_) => Err(gateway(
            StatusCode::GATEWAY_TIMEOUT,
            format!(
                "screenshot of sandbox {id}'s browser: no answer within {SCREENSHOT_TIMEOUT:?}"
            ),
        )),
    }
}

/// The live view: lists the page targets, opens the chosen page's DevTools WebSocket through
/// this server, starts a screencast (JPEG frames pushed by Chromium as the page changes,
/// acknowledged one by one) and forwards clicks, wheel and keys as `Input.*` events.
const VIEW_HTML: &str = include_str!("browser_view.html");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn browser_paths_are_recognised() {
        assert!(is_browser_path("/v1/sandboxes/abc/cdp"));
        assert!(is_browser_path("/v1/sandboxes/abc/cdp/json/version/"));
        assert!(is_browser_path("/v1/sandboxes/abc/cdp/devtools/browser/x"));
        assert!(is_browser_path("/v1/sandboxes/abc/view"));
        assert!(is_browser_path("/v1/sandboxes/abc/screenshot"));
        assert!(!is_browser_path("/v1/sandboxes/abc/cdpx"));
        assert!(!is_browser_path("/v1/sandboxes/abc/files"));
        assert!(!is_browser_path("/v1/sandboxes//cdp"));
        assert!(!is_browser_path("/sandboxes/abc/cdp"));
    }

    #[test]
    fn websocket_urls_point_back_at_the_server() {
        let got = rewrite_ws(
            "ws://localhost/devtools/browser/1b2c",
            "ws",
            "127.0.0.1:7070",
            "sb1",
            "tok",
        );
        assert_eq!(
            got.as_deref(),
            Some("ws://127.0.0.1:7070/v1/sandboxes/sb1/cdp/devtools/browser/1b2c?token=tok")
        );
        let got = rewrite_ws("ws://127.0.0.1:9223/devtools/page/AB", "wss", "h", "s", "t");
        assert_eq!(
            got.as_deref(),
            Some("wss://h/v1/sandboxes/s/cdp/devtools/page/AB?token=t")
        );
        assert_eq!(
            rewrite_ws("ws://localhost/other", "ws", "h", "s", "t"),
            None
        );
    }

    #[test]
    fn targets_lose_the_frontend_url() {
        let mut t = serde_json::json!({
            "id": "AB", "type": "page",
            "devtoolsFrontendUrl": "https://chrome-devtools-frontend.appspot.com/x?ws=127.0.0.1:9223/devtools/page/AB",
            "webSocketDebuggerUrl": "ws://127.0.0.1:9223/devtools/page/AB"
        });
        rewrite_target(&mut t, "ws", "h:1", "s", "t");
        assert!(t.get("devtoolsFrontendUrl").is_none());
        assert_eq!(
            t["webSocketDebuggerUrl"],
            "ws://h:1/v1/sandboxes/s/cdp/devtools/page/AB?token=t"
        );
    }

    #[test]
    fn http_bodies_are_complete_by_length() {
        let full =
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: application/json\r\n\r\n{}";
        assert_eq!(complete_body(full), Some(&b"{}"[..]));
        let part = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n{}";
        assert_eq!(complete_body(part), None);
        let refused = b"HTTP/1.1 500 Internal\r\nContent-Length: 2\r\n\r\nno";
        assert_eq!(complete_body(refused), None);
        assert_eq!(complete_body(b"HTTP/1.1 200 OK\r\n"), None);
    }

    /// What the fake DevTools endpoint saw: (Host, Origin) per request.
    type Seen = std::sync::Arc<std::sync::Mutex<Vec<(String, Option<String>)>>>;

    /// A stand-in for the guest's DevTools endpoint: `/json/version`, `/json/list` and a page
    /// WebSocket that answers `Page.captureScreenshot` with `png`.
    fn fake_devtools(png: &'static [u8]) -> (std::net::SocketAddr, Seen) {
        use std::io::{Read, Write};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let seen: Seen = Default::default();
        let seen2 = seen.clone();
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(mut s) = s else { continue };
                let mut head = [0u8; 4096];
                let n = s.peek(&mut head).unwrap_or(0);
                let text = String::from_utf8_lossy(&head[..n]).to_ascii_lowercase();
                let header = |name: &str| {
                    text.lines()
                        .find_map(|l| l.strip_prefix(&format!("{name}: ")))
                        .map(|v| v.trim().to_string())
                };
                seen2
                    .lock()
                    .unwrap()
                    .push((header("host").unwrap_or_default(), header("origin")));
                if text.contains("upgrade: websocket") {
                    let mut ws = tokio_tungstenite::tungstenite::accept(s).unwrap();
                    let msg = ws.read().unwrap();
                    let v: serde_json::Value =
                        serde_json::from_str(msg.to_text().unwrap()).unwrap();
                    assert_eq!(v["method"], "Page.captureScreenshot");
                    let data = base64::engine::general_purpose::STANDARD.encode(png);
                    let reply = serde_json::json!({"id": v["id"], "result": {"data": data}});
                    ws.send(reply.to_string().into()).unwrap();
                    let _ = ws.read();
                    continue;
                }
                let mut buf = vec![0u8; n];
                let _ = s.read_exact(&mut buf);
                let body = if text.starts_with("get /json/version") {
                    r#"{"Browser": "HeadlessChrome/156", "webSocketDebuggerUrl": "ws://localhost/devtools/browser/B1"}"#
                } else {
                    r#"[{"id": "P1", "type": "page", "url": "about:blank",
                        "devtoolsFrontendUrl": "https://x/?ws=127.0.0.1:9223/devtools/page/P1",
                        "webSocketDebuggerUrl": "ws://127.0.0.1:9223/devtools/page/P1"}]"#
                };
                let _ = write!(
                    s,
                    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        (addr, seen)
    }

    fn get(uri: &str, headers: &[(&str, &str)]) -> axum::http::Request<axum::body::Body> {
        let mut r = axum::http::Request::builder().method("GET").uri(uri);
        for (k, v) in headers {
            r = r.header(*k, *v);
        }
        r.body(axum::body::Body::empty()).unwrap()
    }

    #[tokio::test]
    async fn routes_rewrite_authorize_and_reach_the_guest_as_localhost() {
        use super::super::tests::{send, Fake, KNOWN, TOKEN};
        let fake = std::sync::Arc::new(Fake::default());
        let (addr, seen) = fake_devtools(b"\x89PNG\r\n\x1a\nfake");
        *fake.guest.lock().unwrap() = Some(addr);
        let state = AppState::new(fake.clone(), TOKEN.into());
        let own = ports::access_token(&state, KNOWN);
        let app = super::super::router(state);
        let bearer = format!("Bearer {TOKEN}");
        let base = format!("/v1/sandboxes/{KNOWN}");

        // No token, a wrong one, the server's, the sandbox's (header or query).
        for (uri, headers) in [
            (format!("{base}/cdp"), vec![]),
            (format!("{base}/cdp?token=nope"), vec![]),
            (
                format!("{base}/screenshot"),
                vec![("x-access-token", "nope")],
            ),
            (format!("{base}/view"), vec![]),
        ] {
            let (status, _, _) = send(&app, get(&uri, &headers)).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{uri}");
        }
        let (status, _, body) = send(
            &app,
            get(
                &format!("{base}/cdp/json/version/"),
                &[("authorization", &bearer), ("host", "h.test:7070")],
            ),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            v["webSocketDebuggerUrl"],
            format!("ws://h.test:7070{base}/cdp/devtools/browser/B1?token={own}")
        );
        assert_eq!(v["Browser"], "HeadlessChrome/156");
        let (status, _, body) = send(
            &app,
            get(
                &format!("{base}/cdp/json/list?token={own}"),
                &[("host", "h.test:7070")],
            ),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            v[0]["webSocketDebuggerUrl"],
            format!("ws://h.test:7070{base}/cdp/devtools/page/P1?token={own}")
        );
        assert!(v[0].get("devtoolsFrontendUrl").is_none(), "{v}");

        // The screenshot: the server's own CDP client, through the same connection.
        let (status, headers, body) = send(
            &app,
            get(
                &format!("{base}/screenshot"),
                &[("x-access-token", &own), ("origin", "http://evil.test")],
            ),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
        assert_eq!(headers["content-type"], "image/png");
        assert_eq!(body, b"\x89PNG\r\n\x1a\nfake");

        // The view page carries the sandbox's token, never the server's.
        let (status, _, body) = send(&app, get(&format!("{base}/view?token={own}"), &[])).await;
        assert_eq!(status, StatusCode::OK);
        let html = String::from_utf8(body).unwrap();
        assert!(html.contains(&own) && !html.contains(TOKEN));
        assert!(html.contains("Page.startScreencast"));

        // Every request reached the guest as `localhost`, without an Origin.
        let seen = seen.lock().unwrap().clone();
        assert!(seen.len() >= 4, "{seen:?}");
        for (host, origin) in &seen {
            assert_eq!(host, "localhost", "{seen:?}");
            assert_eq!(origin, &None, "{seen:?}");
        }

        // Nothing listening: no browser. Unknown sandbox: not found.
        *fake.guest.lock().unwrap() = None;
        let (status, _, body) = send(
            &app,
            get(&format!("{base}/cdp"), &[("authorization", &bearer)]),
        )
        .await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert!(String::from_utf8_lossy(&body).contains("no_browser"));
        let (status, _, _) = send(
            &app,
            get(
                "/v1/sandboxes/bbbbbbbbbbbbbbbb/cdp",
                &[("authorization", &bearer)],
            ),
        )
        .await;
        assert_eq!(status, StatusCode::NOT_FOUND);
    }

    #[test]
    fn script_strings_cannot_close_the_script() {
        let s = json_for_script("</script><b>&");
        assert!(!s.contains('<') && !s.contains('>') && !s.contains('&'));
        assert_eq!(serde_json::from_str::<String>(&s).unwrap(), "</script><b>&");
    }
}
