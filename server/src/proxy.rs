//! Reverse proxy of one HTTP request (or WebSocket / `Connection: upgrade` exchange) onto an
//! already-connected TCP stream to a sandbox's port (issue 12: exposed ports).
//!
//! The caller opens the stream (inside the sandbox's network namespace) and hands it to
//! [`forward`] together with the request. The request goes upstream as HTTP/1.1 over hyper's
//! client connection API; both bodies are streamed frame by frame (large uploads and chunked
//! or SSE responses are never buffered whole). Hop-by-hop headers are dropped both ways,
//! `X-Forwarded-*` headers are added, and an upgrade answered with `101` is spliced into a
//! byte pipe between the two upgraded connections.
//!
//! Failures before the upstream's response head are plain HTTP answers with a
//! `{"error":"..."}` body: `502` when the upstream closed, reset or answered garbage, `504`
//! when it did not answer in time. A failure after the head (early close mid-body) ends the
//! client's body with an error, which the server turns into an aborted response.

use std::fmt;
use std::net::IpAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::header::{self, HeaderMap, HeaderName, HeaderValue};
use axum::http::{StatusCode, Uri, Version};
use axum::response::{IntoResponse, Response};
use hyper::body::{Body as HttpBody, Frame, SizeHint};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// How [`forward`] talks to the upstream and what it tells it about the client.
#[derive(Debug, Clone)]
pub struct ProxyOptions {
    /// For the caller's connect to the sandbox's port (default 30 s): [`forward`] receives
    /// an already-connected stream and does not use it; a connect that fails or times out
    /// can be answered with [`ProxyError::Connect`] / [`ProxyError::ConnectTimeout`].
    pub connect_timeout: Duration,
    /// How long the upstream may take to send its response head once the request (body
    /// included) has been sent (default 30 s); then `504`. An upload in progress does not
    /// count against it.
    pub response_header_timeout: Duration,
    /// The client's address, appended to `X-Forwarded-For` (after any list the client
    /// sent). `None` leaves the header as the client sent it.
    pub forwarded_for: Option<IpAddr>,
    /// `X-Forwarded-Proto` (default `"http"`).
    pub forwarded_proto: String,
    /// The path prefix stripped from the request (e.g. `/sandboxes/abc/ports/8080`), sent as
    /// `X-Forwarded-Prefix`. `None` sends no such header (and drops one the client sent).
    pub prefix: Option<String>,
    /// Request headers removed before forwarding (ember's own credentials, e.g.
    /// `Authorization` carrying the server's token, `X-Access-Token`).
    pub strip_headers: Vec<HeaderName>,
}

impl Default for ProxyOptions {
    fn default() -> Self {
        ProxyOptions {
            connect_timeout: Duration::from_secs(30),
            response_header_timeout: Duration::from_secs(30),
            forwarded_for: None,
            forwarded_proto: "http".to_owned(),
            prefix: None,
            strip_headers: Vec::new(),
        }
    }
}

/// The upstream as named in error messages: "the sandbox's port 8080".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Upstream(pub Option<u16>);

impl fmt::Display for Upstream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(port) => write!(f, "the sandbox's port {port}"),
            None => f.write_str("the sandbox's server"),
        }
    }
}

/// Why a request could not be proxied. As a response: the status of
/// [`ProxyError::status`] and `{"error":"<Display>"}`.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The caller's connect to the port failed (refused: nothing listens there).
    #[error("{upstream} is not open: {source}")]
    Connect {
        /// The port.
        upstream: Upstream,
        /// The connect's error.
        #[source]
        source: std::io::Error,
    },
    /// The caller's connect did not complete in time.
    #[error("{upstream} did not accept the connection within {timeout:?}")]
    ConnectTimeout {
        /// The port.
        upstream: Upstream,
        /// The limit.
        timeout: Duration,
    },
    /// The request target given to [`forward`] is not a valid origin-form target.
    #[error("invalid request target {0:?}")]
    BadTarget(String),
    /// The Host value given to [`forward`] is not a valid header value.
    #[error("invalid upstream host {0:?}")]
    BadHost(String),
    /// The HTTP/1.1 handshake over the stream failed.
    #[error("could not start HTTP/1.1 with {upstream}: {source}")]
    Handshake {
        /// The port.
        upstream: Upstream,
        /// hyper's error.
        #[source]
        source: hyper::Error,
    },
    /// The upstream closed the connection before its response head.
    #[error("{upstream} closed the connection before answering")]
    Closed {
        /// The port.
        upstream: Upstream,
    },
    /// The upstream reset the connection before its response head.
    #[error("{upstream} reset the connection before answering")]
    Reset {
        /// The port.
        upstream: Upstream,
    },
    /// The upstream's answer is not a valid HTTP/1.1 response head.
    #[error("{upstream} answered with an invalid HTTP response: {source}")]
    InvalidResponse {
        /// The port.
        upstream: Upstream,
        /// hyper's parse error.
        #[source]
        source: hyper::Error,
    },
    /// The client's request body failed while being sent upstream.
    #[error("the request body could not be read: {source}")]
    RequestBody {
        /// hyper's error (its source is the body's).
        #[source]
        source: hyper::Error,
    },
    /// The upstream switched protocols although the request asked for no upgrade.
    #[error("{upstream} switched protocols without being asked to")]
    UnexpectedUpgrade {
        /// The port.
        upstream: Upstream,
    },
    /// Any other failure of the exchange before the response head.
    #[error("{upstream} failed: {source}")]
    Upstream {
        /// The port.
        upstream: Upstream,
        /// hyper's error.
        #[source]
        source: hyper::Error,
    },
    /// No response head within [`ProxyOptions::response_header_timeout`].
    #[error("{upstream} did not answer within {timeout:?}")]
    Timeout {
        /// The port.
        upstream: Upstream,
        /// The limit.
        timeout: Duration,
    },
}

impl ProxyError {
    /// The HTTP status this error is answered with.
    pub fn status(&self) -> StatusCode {
        match self {
            ProxyError::ConnectTimeout { .. } | ProxyError::Timeout { .. } => {
                StatusCode::GATEWAY_TIMEOUT
            }
            ProxyError::BadTarget(_) | ProxyError::RequestBody { .. } => StatusCode::BAD_REQUEST,
            ProxyError::BadHost(_) => StatusCode::INTERNAL_SERVER_ERROR,
            ProxyError::Connect { .. }
            | ProxyError::Handshake { .. }
            | ProxyError::Closed { .. }
            | ProxyError::Reset { .. }
            | ProxyError::InvalidResponse { .. }
            | ProxyError::UnexpectedUpgrade { .. }
            | ProxyError::Upstream { .. } => StatusCode::BAD_GATEWAY,
        }
    }
}

impl IntoResponse for ProxyError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({ "error": self.to_string() }).to_string();
        let mut resp = (self.status(), body).into_response();
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        resp
    }
}

/// Forwards `req` to the server at the other end of `upstream` as HTTP/1.1 and returns its
/// response (streamed both ways, no full buffering).
///
/// `path_and_query` is what the upstream sees as the request target (the caller strips the
/// `/sandboxes/{id}/ports/{port}` prefix; for the Host route it is the original); an empty
/// one is `/`. `host` is the `Host` header value sent upstream (e.g. `"localhost:8080"`).
///
/// An HTTP/1.x request with `Connection: upgrade` + `Upgrade` is forwarded as an upgrade;
/// when the upstream answers `101`, the client gets `101` with the upstream's headers and a
/// spawned task splices the two upgraded connections until either side closes.
/// Errors are answered as described in [`ProxyError`]; this never panics on what the
/// upstream sends.
pub async fn forward(
    req: Request,
    upstream: TcpStream,
    path_and_query: &str,
    host: &str,
    opts: &ProxyOptions,
) -> Response {
    match try_forward(req, upstream, path_and_query, host, opts).await {
        Ok(resp) => resp,
        Err(err) => {
            tracing::debug!(error = %err, "proxy: request failed");
            err.into_response()
        }
    }
}

/// [`forward`] with the error as a value.
pub async fn try_forward(
    mut req: Request,
    upstream: TcpStream,
    path_and_query: &str,
    host: &str,
    opts: &ProxyOptions,
) -> Result<Response, ProxyError> {
    let target = Upstream(
        upstream
            .peer_addr()
            .ok()
            .map(|a| a.port())
            .or_else(|| host.rsplit_once(':').and_then(|(_, p)| p.parse().ok())),
    );
    let pq = if path_and_query.is_empty() {
        "/"
    } else {
        path_and_query
    };
    let uri: Uri = pq
        .parse()
        .ok()
        .filter(|u: &Uri| u.scheme().is_none() && u.authority().is_none())
        .ok_or_else(|| ProxyError::BadTarget(pq.to_owned()))?;
    let host_value = HeaderValue::from_str(host).map_err(|_| ProxyError::BadHost(host.into()))?;

    let upgrade = matches!(req.version(), Version::HTTP_10 | Version::HTTP_11)
        .then(|| upgrade_protocol(req.headers()))
        .flatten();
    // Taken before the request is consumed: resolves once our 101 has gone to the client.
    let client_upgrade = upgrade.as_ref().map(|_| hyper::upgrade::on(&mut req));

    let (parts, body) = req.into_parts();
    let original_host = parts.headers.get(header::HOST).cloned().or_else(|| {
        parts
            .uri
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
    });
    let mut headers = parts.headers;
    strip_hop_by_hop(&mut headers);
    headers.remove(header::EXPECT); // our server already answered `100 Continue` (or will)
    for name in &opts.strip_headers {
        headers.remove(name);
    }
    if let Some(proto) = &upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(header::UPGRADE, proto.clone());
    }
    headers.insert(header::HOST, host_value);
    add_forwarded(&mut headers, opts, original_host);

    // The response-head clock starts once the request body is through (or gone).
    let (body_done_tx, body_done) = oneshot::channel::<()>();
    let body = if body.is_end_stream() {
        drop(body_done_tx);
        TrackedBody {
            inner: body,
            done: None,
        }
    } else {
        TrackedBody {
            inner: body,
            done: Some(body_done_tx),
        }
    };
    let mut out = hyper::Request::new(body);
    *out.method_mut() = parts.method;
    *out.uri_mut() = uri;
    *out.version_mut() = Version::HTTP_11;
    *out.headers_mut() = headers;

    let (mut sender, conn) = hyper::client::conn::http1::Builder::new()
        .handshake(TokioIo::new(upstream))
        .await
        .map_err(|source| ProxyError::Handshake {
            upstream: target,
            source,
        })?;
    let mut conn_task = AbortOnDrop(Some(tokio::spawn(async move {
        if let Err(err) = conn.with_upgrades().await {
            tracing::debug!(error = %err, "proxy: upstream connection ended with an error");
        }
    })));

    let timeout = opts.response_header_timeout;
    let response = sender.send_request(out);
    tokio::pin!(response);
    let result = tokio::select! {
        r = &mut response => r,
        _ = body_done => match tokio::time::timeout(timeout, &mut response).await {
            Ok(r) => r,
            Err(_) => return Err(ProxyError::Timeout { upstream: target, timeout }),
        },
    };
    drop(sender);
    let mut resp = result.map_err(|e| classify(e, target))?;

    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        let (Some(_), Some(client_upgrade)) = (&upgrade, client_upgrade) else {
            return Err(ProxyError::UnexpectedUpgrade { upstream: target });
        };
        let upstream_upgrade = hyper::upgrade::on(&mut resp);
        let (parts, _) = resp.into_parts();
        let mut headers = parts.headers;
        let proto = headers.get(header::UPGRADE).cloned();
        strip_hop_by_hop(&mut headers);
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        if let Some(proto) = proto {
            headers.insert(header::UPGRADE, proto);
        }
        // The connection task hands the stream over to `upstream_upgrade` when it ends.
        conn_task.disarm();
        tokio::spawn(splice(client_upgrade, upstream_upgrade, target));
        let mut out = Response::new(Body::empty());
        *out.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
        *out.headers_mut() = headers;
        return Ok(out);
    }

    // From here the connection task lives as long as the response body is read.
    conn_task.disarm();
    let (parts, body) = resp.into_parts();
    let mut headers = parts.headers;
    strip_hop_by_hop(&mut headers);
    let mut out = Response::new(Body::new(body));
    *out.status_mut() = parts.status;
    *out.headers_mut() = headers;
    Ok(out)
}

/// Copies bytes both ways between the two upgraded connections until both directions end
/// (a close on one side is passed on as a write shutdown to the other) or one fails.
async fn splice(
    client: hyper::upgrade::OnUpgrade,
    upstream: hyper::upgrade::OnUpgrade,
    target: Upstream,
) {
    let (client, upstream) = tokio::join!(client, upstream);
    match (client, upstream) {
        (Ok(client), Ok(upstream)) => {
            let mut client = TokioIo::new(client);
            let mut upstream = TokioIo::new(upstream);
            match tokio::io::copy_bidirectional(&mut client, &mut upstream).await {
                Ok((up, down)) => {
                    tracing::debug!(%target, up, down, "proxy: upgraded connection closed")
                }
                Err(err) => {
                    tracing::debug!(%target, error = %err, "proxy: upgraded connection failed")
                }
            }
        }
        (Err(err), _) | (_, Err(err)) => {
            tracing::debug!(%target, error = %err, "proxy: upgrade did not complete");
        }
    }
}

/// The error of the exchange before the response head, named for the client.
fn classify(err: hyper::Error, upstream: Upstream) -> ProxyError {
    if err.is_parse() || err.is_parse_status() || err.is_parse_too_large() {
        return ProxyError::InvalidResponse {
            upstream,
            source: err,
        };
    }
    if err.is_incomplete_message() || err.is_closed() || err.is_canceled() {
        return ProxyError::Closed { upstream };
    }
    // A failing request body (hyper's `User::Body`) carries the body's error as its source.
    if err.is_user() && std::error::Error::source(&err).is_some() {
        return ProxyError::RequestBody { source: err };
    }
    match io_error_kind(&err) {
        Some(std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::ConnectionAborted) => {
            ProxyError::Reset { upstream }
        }
        Some(
            std::io::ErrorKind::BrokenPipe
            | std::io::ErrorKind::UnexpectedEof
            | std::io::ErrorKind::NotConnected,
        ) => ProxyError::Closed { upstream },
        _ => ProxyError::Upstream {
            upstream,
            source: err,
        },
    }
}

/// The kind of the first `io::Error` in `err`'s source chain.
fn io_error_kind(err: &(dyn std::error::Error + 'static)) -> Option<std::io::ErrorKind> {
    let mut cur = Some(err);
    while let Some(e) = cur {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            return Some(io.kind());
        }
        cur = e.source();
    }
    None
}

/// The `Upgrade` value of an upgrade request: `Connection` names `upgrade` and `Upgrade`
/// is present.
fn upgrade_protocol(headers: &HeaderMap) -> Option<HeaderValue> {
    connection_tokens(headers)
        .any(|t| t.eq_ignore_ascii_case("upgrade"))
        .then(|| headers.get(header::UPGRADE).cloned())
        .flatten()
}

/// The comma-separated tokens of every `Connection` header.
fn connection_tokens(headers: &HeaderMap) -> impl Iterator<Item = &str> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|t| !t.is_empty())
}

/// Removes the hop-by-hop headers: those `Connection` names, `Connection` itself,
/// `Keep-Alive`, `Proxy-*`, `TE`, `Trailer`, `Transfer-Encoding` and `Upgrade`.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = connection_tokens(headers)
        .filter_map(|t| HeaderName::from_bytes(t.as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in [
        header::CONNECTION,
        HeaderName::from_static("keep-alive"),
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
    ] {
        headers.remove(name);
    }
    let proxy: Vec<HeaderName> = headers
        .keys()
        .filter(|k| k.as_str().starts_with("proxy-"))
        .cloned()
        .collect();
    for name in proxy {
        headers.remove(name);
    }
}

/// Sets `X-Forwarded-For` (appended), `-Proto`, `-Host` and `-Prefix`.
fn add_forwarded(headers: &mut HeaderMap, opts: &ProxyOptions, original_host: Option<HeaderValue>) {
    const XFF: HeaderName = HeaderName::from_static("x-forwarded-for");
    const XFP: HeaderName = HeaderName::from_static("x-forwarded-proto");
    const XFH: HeaderName = HeaderName::from_static("x-forwarded-host");
    const XFX: HeaderName = HeaderName::from_static("x-forwarded-prefix");

    if let Some(ip) = opts.forwarded_for {
        let prior: Vec<&str> = headers
            .get_all(&XFF)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .collect();
        let ip = ip.to_string();
        let value = if prior.is_empty() {
            ip
        } else {
            format!("{}, {ip}", prior.join(", "))
        };
        if let Ok(value) = HeaderValue::from_str(&value) {
            headers.insert(XFF, value);
        }
    }
    match HeaderValue::from_str(&opts.forwarded_proto) {
        Ok(v) => {
            headers.insert(XFP, v);
        }
        Err(_) => {
            headers.remove(XFP);
        }
    }
    match original_host {
        Some(v) => {
            headers.insert(XFH, v);
        }
        None => {
            headers.remove(XFH);
        }
    }
    match opts
        .prefix
        .as_deref()
        .and_then(|p| HeaderValue::from_str(p).ok())
    {
        Some(v) => {
            headers.insert(XFX, v);
        }
        None => {
            headers.remove(XFX);
        }
    }
}

/// The request body, dropping `done` when it has ended (or failed, or is dropped): the
/// signal that the response-head timeout may start.
struct TrackedBody {
    inner: Body,
    done: Option<oneshot::Sender<()>>,
}

impl HttpBody for TrackedBody {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        let poll = Pin::new(&mut this.inner).poll_frame(cx);
        if matches!(poll, Poll::Ready(None) | Poll::Ready(Some(Err(_)))) {
            this.done = None;
        }
        poll
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Aborts the upstream connection's task when dropped armed: a request given up on
/// (timeout, error, client gone) does not leave the connection open.
struct AbortOnDrop(Option<JoinHandle<()>>);

impl AbortOnDrop {
    fn disarm(&mut self) {
        self.0 = None;
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(task) = self.0.take() {
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::net::SocketAddr;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Instant;

    use axum::extract::State;
    use axum::routing::{any, get, post};
    use axum::{Json, Router};
    use bytes::Bytes;
    use futures_util::{SinkExt, StreamExt};
    use http_body_util::BodyExt;
    use sha2::{Digest, Sha256};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;
    use tokio::sync::{mpsc, Notify};
    use tokio_tungstenite::tungstenite::handshake::server::{
        Request as WsRequest, Response as WsResponse,
    };
    use tokio_tungstenite::tungstenite::Message;

    use super::*;

    const WAIT: Duration = Duration::from_secs(10);

    async fn serve(app: Router) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        addr
    }

    /// A raw TCP upstream: `on_conn` gets every accepted connection.
    async fn raw_upstream<F, Fut>(on_conn: F) -> SocketAddr
    where
        F: Fn(TcpStream) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                tokio::spawn(on_conn(conn));
            }
        });
        addr
    }

    /// Reads up to the end of a request head.
    async fn read_head(conn: &mut TcpStream) {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 1024];
        while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
            match conn.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    }

    #[derive(Clone)]
    struct Target {
        upstream: SocketAddr,
        opts: Arc<ProxyOptions>,
    }

    /// The proxy under test: `/p/<rest>` goes to the upstream's `/<rest>`.
    async fn proxy(upstream: SocketAddr, opts: ProxyOptions) -> SocketAddr {
        async fn handler(State(t): State<Target>, req: Request) -> Response {
            let pq = req.uri().path_and_query().map_or("/", |p| p.as_str());
            let rest = pq.strip_prefix("/p").unwrap_or(pq).to_owned();
            let stream = TcpStream::connect(t.upstream).await.unwrap();
            let host = format!("localhost:{}", t.upstream.port());
            forward(req, stream, &rest, &host, &t.opts).await
        }
        let target = Target {
            upstream,
            opts: Arc::new(opts),
        };
        serve(Router::new().fallback(handler).with_state(target)).await
    }

    /// One request over a fresh HTTP/1.1 connection.
    async fn send(addr: SocketAddr, req: hyper::Request<Body>) -> hyper::Response<Body> {
        let stream = TcpStream::connect(addr).await.unwrap();
        let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(conn);
        let resp = tokio::time::timeout(WAIT, tx.send_request(req))
            .await
            .unwrap()
            .unwrap();
        resp.map(Body::new)
    }

    fn get_req(uri: &str) -> hyper::Request<Body> {
        hyper::Request::get(uri)
            .header(header::HOST, "proxy.test")
            .body(Body::empty())
            .unwrap()
    }

    async fn body_bytes(resp: hyper::Response<Body>) -> Bytes {
        tokio::time::timeout(WAIT, resp.into_body().collect())
            .await
            .unwrap()
            .unwrap()
            .to_bytes()
    }

    async fn body_json(resp: hyper::Response<Body>) -> serde_json::Value {
        serde_json::from_slice(&body_bytes(resp).await).unwrap()
    }

    /// `/echo`: method, target and headers as JSON. `/upload`: length and sha256 of the
    /// body. `/stream`: "first", then (after `release`) "second".
    struct Upstream {
        addr: SocketAddr,
        release: Arc<Notify>,
        second_sent: Arc<AtomicBool>,
    }

    async fn upstream() -> Upstream {
        async fn echo(req: Request) -> Json<serde_json::Value> {
            let mut headers = serde_json::Map::new();
            for name in req.headers().keys() {
                let values: Vec<_> = req
                    .headers()
                    .get_all(name)
                    .iter()
                    .map(|v| serde_json::Value::from(v.to_str().unwrap_or("?")))
                    .collect();
                headers.insert(name.to_string(), values.into());
            }
            Json(serde_json::json!({
                "method": req.method().as_str(),
                "uri": req.uri().to_string(),
                "headers": headers,
            }))
        }
        async fn upload(req: Request) -> Json<serde_json::Value> {
            let te = req
                .headers()
                .get(header::TRANSFER_ENCODING)
                .map(|v| v.to_str().unwrap().to_owned());
            let mut body = req.into_body().into_data_stream();
            let (mut len, mut sha) = (0usize, Sha256::new());
            while let Some(chunk) = body.next().await {
                let chunk = chunk.unwrap();
                len += chunk.len();
                sha.update(&chunk);
            }
            Json(serde_json::json!({
                "len": len, "sha": format!("{:x}", sha.finalize()), "te": te,
            }))
        }
        async fn stream(
            State((release, second_sent)): State<(Arc<Notify>, Arc<AtomicBool>)>,
        ) -> Response {
            let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(1);
            tokio::spawn(async move {
                tx.send(Ok(Bytes::from_static(b"first"))).await.unwrap();
                let _ = tokio::time::timeout(WAIT, release.notified()).await;
                second_sent.store(true, Ordering::SeqCst);
                let _ = tx.send(Ok(Bytes::from_static(b"second"))).await;
            });
            let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
            ([(header::CONTENT_TYPE, "text/event-stream")], body).into_response()
        }
        let release = Arc::new(Notify::new());
        let second_sent = Arc::new(AtomicBool::new(false));
        let app = Router::new()
            .route("/echo", any(echo))
            .route("/upload", post(upload))
            .route("/stream", get(stream))
            .with_state((release.clone(), second_sent.clone()));
        Upstream {
            addr: serve(app).await,
            release,
            second_sent,
        }
    }

    #[tokio::test]
    async fn get_with_query_string() {
        let up = upstream().await;
        let px = proxy(up.addr, ProxyOptions::default()).await;
        let resp = send(px, get_req("/p/echo?a=1&b=two%20words")).await;
        assert_eq!(resp.status(), StatusCode::OK);
        let echo = body_json(resp).await;
        assert_eq!(echo["method"], "GET");
        assert_eq!(echo["uri"], "/echo?a=1&b=two%20words");
        assert_eq!(
            echo["headers"]["host"][0],
            format!("localhost:{}", up.addr.port())
        );
    }

    #[tokio::test]
    async fn post_streams_a_5_mib_body() {
        let up = upstream().await;
        let px = proxy(up.addr, ProxyOptions::default()).await;
        let chunk: Vec<u8> = (0..64 * 1024).map(|i| (i % 251) as u8).collect();
        let mut sha = Sha256::new();
        for _ in 0..80 {
            sha.update(&chunk);
        }
        let want = format!("{:x}", sha.finalize());
        let chunks = futures_util::stream::iter(
            (0..80).map(move |_| Ok::<_, std::io::Error>(Bytes::from(chunk.clone()))),
        );
        let req = hyper::Request::post("/p/upload")
            .header(header::HOST, "proxy.test")
            .body(Body::from_stream(chunks))
            .unwrap();
        let resp = send(px, req).await;
        assert_eq!(resp.status(), StatusCode::OK);
        let got = body_json(resp).await;
        assert_eq!(got["len"], 5 * 1024 * 1024);
        assert_eq!(got["sha"], want);
        // Passed on as a stream, not collected into a Content-Length body first.
        assert_eq!(got["te"], "chunked");
    }

    #[tokio::test]
    async fn request_headers_stripped_and_forwarded_added() {
        let up = upstream().await;
        let opts = ProxyOptions {
            forwarded_for: Some("192.0.2.7".parse().unwrap()),
            prefix: Some("/p".into()),
            strip_headers: vec![
                header::AUTHORIZATION,
                HeaderName::from_static("x-access-token"),
            ],
            ..ProxyOptions::default()
        };
        let px = proxy(up.addr, opts).await;
        let req = hyper::Request::get("/p/echo")
            .header(header::HOST, "proxy.test")
            .header(header::CONNECTION, "keep-alive, x-hop")
            .header("x-hop", "1")
            .header("keep-alive", "timeout=5")
            .header("proxy-authorization", "Basic eA==")
            .header("proxy-connection", "keep-alive")
            .header(header::TE, "trailers")
            .header(header::UPGRADE, "h2c")
            .header(header::AUTHORIZATION, "Bearer ember-token")
            .header("x-access-token", "secret")
            .header("x-custom", "kept")
            .header("x-forwarded-for", "10.0.0.1")
            .body(Body::empty())
            .unwrap();
        let echo = body_json(send(px, req).await).await;
        let h = &echo["headers"];
        for gone in [
            "connection",
            "x-hop",
            "keep-alive",
            "proxy-authorization",
            "proxy-connection",
            "te",
            "upgrade",
            "authorization",
            "x-access-token",
        ] {
            assert!(h.get(gone).is_none(), "{gone} was forwarded: {h}");
        }
        assert_eq!(h["x-custom"][0], "kept");
        assert_eq!(h["host"][0], format!("localhost:{}", up.addr.port()));
        assert_eq!(h["x-forwarded-for"][0], "10.0.0.1, 192.0.2.7");
        assert_eq!(h["x-forwarded-proto"][0], "http");
        assert_eq!(h["x-forwarded-host"][0], "proxy.test");
        assert_eq!(h["x-forwarded-prefix"][0], "/p");
    }

    #[tokio::test]
    async fn response_hop_by_hop_headers_stripped() {
        let up = raw_upstream(|mut conn| async move {
            read_head(&mut conn).await;
            let _ = conn
                .write_all(
                    b"HTTP/1.1 200 OK\r\nConnection: close, x-resp-hop\r\nX-Resp-Hop: 1\r\n\
                      Keep-Alive: timeout=5\r\nProxy-Authenticate: Basic\r\nX-Kept: yes\r\n\
                      Content-Length: 2\r\n\r\nok",
                )
                .await;
        })
        .await;
        let px = proxy(up, ProxyOptions::default()).await;
        let resp = send(px, get_req("/p/")).await;
        assert_eq!(resp.status(), StatusCode::OK);
        let h = resp.headers().clone();
        assert_eq!(h["x-kept"], "yes");
        assert_eq!(h[header::CONTENT_LENGTH], "2");
        for gone in ["x-resp-hop", "keep-alive", "proxy-authenticate"] {
            assert!(h.get(gone).is_none(), "{gone} came back: {h:?}");
        }
        assert_eq!(body_bytes(resp).await, "ok");
    }

    #[tokio::test]
    async fn streamed_response_flows_chunk_by_chunk() {
        let up = upstream().await;
        let px = proxy(up.addr, ProxyOptions::default()).await;
        let resp = send(px, get_req("/p/stream")).await;
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(resp.headers()[header::CONTENT_TYPE], "text/event-stream");
        let mut body = resp.into_body();
        let first = tokio::time::timeout(WAIT, body.frame())
            .await
            .expect("the first chunk arrives while the upstream holds the second")
            .unwrap()
            .unwrap()
            .into_data()
            .unwrap();
        assert_eq!(first, "first");
        assert!(!up.second_sent.load(Ordering::SeqCst));
        up.release.notify_one();
        let rest = tokio::time::timeout(WAIT, body.collect())
            .await
            .unwrap()
            .unwrap()
            .to_bytes();
        assert_eq!(rest, "second");
        assert!(up.second_sent.load(Ordering::SeqCst));
    }

    /// A WebSocket echo server; reports each handshake's target and Host, closes on "bye".
    async fn ws_upstream() -> (SocketAddr, mpsc::UnboundedReceiver<(String, String)>) {
        let (seen_tx, seen_rx) = mpsc::unbounded_channel();
        let addr = raw_upstream(move |conn| {
            let seen_tx = seen_tx.clone();
            async move {
                #[allow(clippy::result_large_err)] // tungstenite's callback signature
                let callback = |req: &WsRequest, resp: WsResponse| {
                    let host = req.headers()[header::HOST].to_str().unwrap().to_owned();
                    let _ = seen_tx.send((req.uri().to_string(), host));
                    Ok(resp)
                };
                let mut ws = tokio_tungstenite::accept_hdr_async(conn, callback)
                    .await
                    .unwrap();
                while let Some(Ok(msg)) = ws.next().await {
                    let echo = match msg {
                        Message::Text(t) if t.as_str() == "bye" => {
                            let _ = ws.close(None).await;
                            continue;
                        }
                        Message::Text(_) | Message::Binary(_) => msg,
                        _ => continue,
                    };
                    if ws.send(echo).await.is_err() {
                        break;
                    }
                }
            }
        })
        .await;
        (addr, seen_rx)
    }

    #[tokio::test]
    async fn websocket_echo_through_the_proxy() {
        let (up, mut seen) = ws_upstream().await;
        let px = proxy(up, ProxyOptions::default()).await;

        // Client closes.
        let stream = TcpStream::connect(px).await.unwrap();
        let (mut ws, resp) = tokio_tungstenite::client_async(format!("ws://{px}/p/ws?x=1"), stream)
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::SWITCHING_PROTOCOLS);
        let (target, host) = seen.recv().await.unwrap();
        assert_eq!(target, "/ws?x=1");
        assert_eq!(host, format!("localhost:{}", up.port()));

        ws.send(Message::text("hello")).await.unwrap();
        let got = tokio::time::timeout(WAIT, ws.next()).await.unwrap();
        assert_eq!(got.unwrap().unwrap(), Message::text("hello"));
        let bin = vec![0u8, 1, 2, 255];
        ws.send(Message::binary(bin.clone())).await.unwrap();
        let got = tokio::time::timeout(WAIT, ws.next()).await.unwrap();
        assert_eq!(got.unwrap().unwrap(), Message::binary(bin));
        ws.close(None).await.unwrap();
        let got = tokio::time::timeout(WAIT, ws.next()).await.unwrap();
        assert!(matches!(got, Some(Ok(Message::Close(_)))), "{got:?}");
        let end = tokio::time::timeout(WAIT, ws.next()).await.unwrap();
        assert!(end.is_none(), "{end:?}");

        // Upstream closes.
        let stream = TcpStream::connect(px).await.unwrap();
        let (mut ws, _) = tokio_tungstenite::client_async(format!("ws://{px}/p/ws"), stream)
            .await
            .unwrap();
        ws.send(Message::text("bye")).await.unwrap();
        let got = tokio::time::timeout(WAIT, ws.next()).await.unwrap();
        assert!(matches!(got, Some(Ok(Message::Close(_)))), "{got:?}");
        let end = tokio::time::timeout(WAIT, ws.next()).await.unwrap();
        assert!(end.is_none(), "{end:?}");
    }

    #[tokio::test]
    async fn upgrade_not_accepted_is_an_ordinary_response() {
        let up = upstream().await;
        let px = proxy(up.addr, ProxyOptions::default()).await;
        let req = hyper::Request::get("/p/echo")
            .header(header::HOST, "proxy.test")
            .header(header::CONNECTION, "Upgrade")
            .header(header::UPGRADE, "websocket")
            .body(Body::empty())
            .unwrap();
        let resp = send(px, req).await;
        assert_eq!(resp.status(), StatusCode::OK);
        let echo = body_json(resp).await;
        // The upgrade request went upstream as one.
        assert_eq!(echo["headers"]["upgrade"][0], "websocket");
        assert_eq!(echo["headers"]["connection"][0], "upgrade");
    }

    async fn error_of(resp: hyper::Response<Body>) -> String {
        assert_eq!(resp.headers()[header::CONTENT_TYPE], "application/json");
        let v = body_json(resp).await;
        v["error"].as_str().unwrap().to_owned()
    }

    #[tokio::test]
    async fn upstream_closing_without_an_answer_is_502() {
        let up = raw_upstream(|mut conn| async move {
            read_head(&mut conn).await;
        })
        .await;
        let px = proxy(up, ProxyOptions::default()).await;
        let resp = send(px, get_req("/p/")).await;
        assert_eq!(resp.status(), StatusCode::BAD_GATEWAY);
        assert_eq!(
            error_of(resp).await,
            format!(
                "the sandbox's port {} closed the connection before answering",
                up.port()
            )
        );
    }

    #[tokio::test]
    async fn invalid_upstream_response_is_502() {
        let up = raw_upstream(|mut conn| async move {
            read_head(&mut conn).await;
            let _ = conn.write_all(b"SSH-2.0-OpenSSH_9.6\r\n\r\n").await;
        })
        .await;
        let px = proxy(up, ProxyOptions::default()).await;
        let resp = send(px, get_req("/p/")).await;
        assert_eq!(resp.status(), StatusCode::BAD_GATEWAY);
        let err = error_of(resp).await;
        assert!(
            err.contains("answered with an invalid HTTP response"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn upstream_never_answering_is_504() {
        let up = raw_upstream(|mut conn| async move {
            read_head(&mut conn).await;
            tokio::time::sleep(Duration::from_secs(60)).await;
            drop(conn);
        })
        .await;
        let opts = ProxyOptions {
            response_header_timeout: Duration::from_millis(300),
            ..ProxyOptions::default()
        };
        let px = proxy(up, opts).await;
        let start = Instant::now();
        let resp = send(px, get_req("/p/")).await;
        assert_eq!(resp.status(), StatusCode::GATEWAY_TIMEOUT);
        assert!(start.elapsed() < Duration::from_secs(5));
        let err = error_of(resp).await;
        assert!(err.contains("did not answer within 300ms"), "{err}");
    }

    #[tokio::test]
    async fn slow_upload_does_not_count_against_the_header_timeout() {
        let up = upstream().await;
        let opts = ProxyOptions {
            response_header_timeout: Duration::from_millis(200),
            ..ProxyOptions::default()
        };
        let px = proxy(up.addr, opts).await;
        let chunks = futures_util::stream::iter(0..4).then(|_| async {
            tokio::time::sleep(Duration::from_millis(150)).await;
            Ok::<_, std::io::Error>(Bytes::from_static(b"0123456789"))
        });
        let req = hyper::Request::post("/p/upload")
            .body(Body::from_stream(chunks))
            .unwrap();
        let resp = send(px, req).await;
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(body_json(resp).await["len"], 40);
    }

    #[tokio::test]
    async fn early_close_mid_body_ends_the_client_body_with_an_error() {
        let up = raw_upstream(|mut conn| async move {
            read_head(&mut conn).await;
            let _ = conn
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nabc")
                .await;
        })
        .await;
        let px = proxy(up, ProxyOptions::default()).await;
        let resp = send(px, get_req("/p/")).await;
        assert_eq!(resp.status(), StatusCode::OK);
        let body = tokio::time::timeout(WAIT, resp.into_body().collect())
            .await
            .unwrap();
        assert!(body.is_err());
    }

    #[tokio::test]
    async fn errors_name_the_problem() {
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let err = ProxyError::Connect {
            upstream: Upstream(Some(8080)),
            source: refused,
        };
        assert_eq!(err.status(), StatusCode::BAD_GATEWAY);
        assert!(err
            .to_string()
            .starts_with("the sandbox's port 8080 is not open"));
        let err = ProxyError::ConnectTimeout {
            upstream: Upstream(None),
            timeout: Duration::from_secs(30),
        };
        assert_eq!(err.status(), StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(
            err.to_string(),
            "the sandbox's server did not accept the connection within 30s"
        );
    }
}
