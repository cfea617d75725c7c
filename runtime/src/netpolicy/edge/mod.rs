//! The egress proxy: credentials added at the edge, outside the guest.
//!
//! A sandbox whose policy has `rules` gets two listeners in its namespace, on the gateway
//! address (only its own guest reaches them): [`TLS_PORT`] and [`HTTP_PORT`]. Its resolver
//! reports every answer for a rule host, whose addresses go into the namespace's `edge4` set;
//! the guest's TCP 443 and 80 to those addresses are DNATed to the listeners
//! ([`super::nft::sandbox`]). Every other destination keeps the ordinary forwarded path.
//!
//! HTTPS: the proxy reads the ClientHello, and only a server name that is a rule host is
//! served (with a leaf for that name from the per-server CA, [`ca`]); any other name is
//! refused. Each HTTP/1.1 request then has its `Host` checked against that name, the rule's
//! headers set (placeholders resolved from the secrets store *now*, so a rotation applies to
//! the next request), and is sent over the proxy's own connection to the host: the name
//! resolved by the proxy through the sandbox's upstream resolver (never the address the
//! guest connected to), the address checked against the policy's deny lists, TLS verified
//! against the upstream trust store for that name. HTTP (port 80) is the same without TLS,
//! the rule host taken from `Host`.
//!
//! Any failure (unresolvable host, upstream certificate that does not verify, secret
//! missing) is a `502` to the guest with the reason in [`ERROR_HEADER`], counted and sampled
//! in the sandbox's [`EdgeStats`]: a request is never sent without its credential or with a
//! placeholder left in.

pub mod ca;

use std::convert::Infallible;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use utoipa::ToSchema;

use super::dns::Resolver;
use super::policy::{Cidr4, NetworkPolicy, DEFAULT_DENY};
use crate::secrets::{SecretError, Secrets};

/// The HTTPS listener's port on the gateway address.
pub const TLS_PORT: u16 = 15443;
/// The HTTP listener's port on the gateway address.
pub const HTTP_PORT: u16 = 15080;
/// The SOCKS5 relay's port on the gateway address (a policy with `egress_proxy`).
pub const SOCKS_RELAY_PORT: u16 = 15081;
/// The response header that says why the proxy answered 502 itself.
pub const ERROR_HEADER: &str = "x-ember-edge-error";
/// Where sandboxes with rules find the CA bundle (the system's roots and the proxy's CA).
pub const GUEST_CA_BUNDLE: &str = "/etc/ssl/certs/ember-edge-bundle.pem";
/// The variables that point TLS clients in the guest at [`GUEST_CA_BUNDLE`].
pub const GUEST_CA_ENV: &[&str] = &[
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS",
];
/// Time limits: the guest's TLS handshake, the upstream connect and handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Failures kept as samples.
const MAX_SAMPLES: usize = 16;
/// Most connections from one sandbox the proxy serves at once (more are closed at once,
/// counted as refused): the guest cannot tie up the server's memory and sockets.
pub const MAX_CONNECTIONS: usize = 64;

/// A sandbox's proxy counters (in `GET /sandboxes/{id}/network`'s `stats.edge`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct EdgeStats {
    /// Requests the proxy handled.
    pub requests: u64,
    /// Requests sent upstream with the rules' headers.
    pub forwarded: u64,
    /// Requests answered with a 502 by the proxy.
    pub failed: u64,
    /// Connections refused before any request (a TLS name that is not a rule host).
    pub refused_connections: u64,
    /// Connections tunnelled through the policy's `egress_proxy`.
    #[serde(default)]
    pub relayed: u64,
    /// The latest failures, `host: reason` (never a secret's value).
    pub failures: Vec<String>,
}

/// What the proxies of one runtime share.
pub struct EdgeShared {
    /// The CA guests trust.
    pub ca: ca::EdgeCa,
    client: Arc<rustls::ClientConfig>,
    secrets: Option<Arc<Secrets>>,
}

impl std::fmt::Debug for EdgeShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EdgeShared").finish_non_exhaustive()
    }
}

/// Loads PEM certificates from `path` into `roots`; how many.
fn add_pem_roots(
    roots: &mut rustls::RootCertStore,
    path: &std::path::Path,
) -> Result<usize, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;
    let mut n = 0;
    for c in CertificateDer::pem_file_iter(path).map_err(|e| format!("{}: {e}", path.display()))? {
        let c = c.map_err(|e| format!("{}: {e}", path.display()))?;
        if roots.add(c).is_ok() {
            n += 1;
        }
    }
    Ok(n)
}

/// The system's CA bundle (Debian's path, then others).
pub fn system_bundle() -> Option<std::path::PathBuf> {
    [
        "/etc/ssl/certs/ca-certificates.crt",
        "/etc/pki/tls/certs/ca-bundle.crt",
        "/etc/ssl/cert.pem",
    ]
    .into_iter()
    .map(std::path::PathBuf::from)
    .find(|p| p.exists())
}

impl EdgeShared {
    /// The CA under `ca_dir`, upstream trust from `upstream_ca` (a PEM bundle that replaces
    /// the system's) or the system bundle.
    pub fn new(
        ca_dir: &std::path::Path,
        upstream_ca: Option<&std::path::Path>,
        secrets: Option<Arc<Secrets>>,
    ) -> Result<EdgeShared, String> {
        let ca = ca::EdgeCa::load_or_create(ca_dir).map_err(|e| e.to_string())?;
        let mut roots = rustls::RootCertStore::empty();
        match upstream_ca {
            Some(p) => {
                if add_pem_roots(&mut roots, p)? == 0 {
                    return Err(format!("{}: no certificate", p.display()));
                }
            }
            None => match system_bundle() {
                Some(p) => {
                    add_pem_roots(&mut roots, &p)?;
                }
                None => tracing::warn!(
                    "no system CA bundle: the egress proxy trusts no upstream certificate"
                ),
            },
        }
        let mut client = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
        client.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(EdgeShared {
            ca,
            client: Arc::new(client),
            secrets,
        })
    }

    fn secret(&self, name: &str) -> Result<String, SecretError> {
        match &self.secrets {
            Some(s) => s.reveal(name),
            None => Err(SecretError::NotFound(name.to_string())),
        }
    }
}

/// One sandbox's proxy.
pub struct EdgeSandbox {
    name: String,
    policy: RwLock<NetworkPolicy>,
    resolver: Arc<Resolver>,
    /// Addresses denied besides the policy's: the host's own and the sandboxes' pool.
    extra_deny: Vec<Cidr4>,
    stats: Mutex<EdgeStats>,
    connections: Arc<tokio::sync::Semaphore>,
}

impl std::fmt::Debug for EdgeSandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EdgeSandbox")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl EdgeSandbox {
    /// The proxy of namespace `name`, resolving through `resolver`.
    pub fn new(
        name: &str,
        policy: NetworkPolicy,
        resolver: Arc<Resolver>,
        extra_deny: Vec<Cidr4>,
    ) -> EdgeSandbox {
        EdgeSandbox {
            name: name.to_string(),
            policy: RwLock::new(policy),
            resolver,
            extra_deny,
            stats: Mutex::new(EdgeStats::default()),
            connections: Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS)),
        }
    }

    /// Replaces the policy (its rules apply from the next request).
    pub fn set_policy(&self, policy: NetworkPolicy) {
        *self.policy.write().unwrap_or_else(|p| p.into_inner()) = policy;
    }

    fn policy(&self) -> NetworkPolicy {
        self.policy
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Whether `host` (lower case) has rules.
    pub fn is_rule_host(&self, host: &str) -> bool {
        self.policy
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .rules
            .contains_key(host.trim_end_matches('.'))
    }

    /// The counters so far.
    pub fn stats(&self) -> EdgeStats {
        self.stats.lock().map(|s| s.clone()).unwrap_or_default()
    }

    fn bump(&self, f: impl FnOnce(&mut EdgeStats)) {
        let mut s = self.stats.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut s);
    }

    /// A place for one more connection, or None (counted) when the sandbox has
    /// [`MAX_CONNECTIONS`].
    fn admit(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        let p = self.connections.clone().try_acquire_owned().ok();
        if p.is_none() {
            self.bump(|s| s.refused_connections += 1);
        }
        p
    }

    fn sample(&self, line: String) {
        self.bump(|s| {
            if s.failures.len() >= MAX_SAMPLES {
                s.failures.remove(0);
            }
            s.failures.push(line);
        });
    }

    /// Whether the policy lets the proxy connect to `ip` (the forward chain's order: an
    /// `allow_cidrs` entry, then the deny lists).
    fn admits(&self, policy: &NetworkPolicy, ip: Ipv4Addr) -> bool {
        if NetworkPolicy::cidrs(&policy.allow_cidrs)
            .iter()
            .any(|c| c.contains(ip))
        {
            return true;
        }
        let denied = DEFAULT_DENY
            .iter()
            .filter_map(|d| Cidr4::parse(d).ok())
            .chain(NetworkPolicy::cidrs(&policy.deny_cidrs))
            .chain(self.extra_deny.iter().copied())
            .any(|c| c.contains(ip));
        !denied
    }
}

impl EdgeSandbox {
    /// A connection to `addr`: direct, or through the policy's SOCKS5 proxy.
    async fn connect(
        &self,
        policy: &NetworkPolicy,
        addr: SocketAddr,
    ) -> std::io::Result<TcpStream> {
        let SocketAddr::V4(dst) = addr else {
            return Err(std::io::Error::other("IPv6 is not reachable"));
        };
        match &policy.egress_proxy {
            None => TcpStream::connect(addr).await,
            Some(p) => {
                let proxy = p.socket_addr().map_err(std::io::Error::other)?;
                if !self.admits(policy, *proxy.ip()) {
                    return Err(std::io::Error::other(format!(
                        "the egress proxy {proxy} is denied by the policy (allow_cidrs)"
                    )));
                }
                socks5_connect(proxy, dst).await
            }
        }
    }
}

/// A TCP connection to `dst` through the SOCKS5 proxy at `proxy` (no authentication,
/// CONNECT by address).
pub async fn socks5_connect(proxy: SocketAddrV4, dst: SocketAddrV4) -> std::io::Result<TcpStream> {
    let bad = |what: String| std::io::Error::other(format!("SOCKS5 proxy {proxy}: {what}"));
    let mut s = TcpStream::connect(proxy).await?;
    s.write_all(&[5, 1, 0]).await?;
    let mut hello = [0u8; 2];
    s.read_exact(&mut hello).await?;
    if hello != [5, 0] {
        return Err(bad(format!(
            "refused the no-authentication method ({hello:?})"
        )));
    }
    let mut req = vec![5, 1, 0, 1];
    req.extend_from_slice(&dst.ip().octets());
    req.extend_from_slice(&dst.port().to_be_bytes());
    s.write_all(&req).await?;
    let mut head = [0u8; 4];
    s.read_exact(&mut head).await?;
    if head[0] != 5 || head[1] != 0 {
        return Err(bad(format!("CONNECT {dst} answered code {}", head[1])));
    }
    let rest = match head[3] {
        1 => 4 + 2,
        4 => 16 + 2,
        3 => {
            let mut n = [0u8; 1];
            s.read_exact(&mut n).await?;
            usize::from(n[0]) + 2
        }
        t => return Err(bad(format!("unknown address type {t} in its reply"))),
    };
    let mut skip = vec![0u8; rest];
    s.read_exact(&mut skip).await?;
    Ok(s)
}

/// Where a connection DNATed to the relay was going.
fn original_dst(s: &TcpStream) -> std::io::Result<SocketAddrV4> {
    let mut addr = libc::sockaddr_in {
        sin_family: 0,
        sin_port: 0,
        sin_addr: libc::in_addr { s_addr: 0 },
        sin_zero: [0; 8],
    };
    let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: getsockopt(2) writes at most `len` bytes into `addr`, a sockaddr_in we own and
    // whose size `len` states; the descriptor is the live socket `s` borrows.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_IP,
            libc::SO_ORIGINAL_DST,
            (&mut addr as *mut libc::sockaddr_in).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(SocketAddrV4::new(
        Ipv4Addr::from(u32::from_be(addr.sin_addr.s_addr)),
        u16::from_be(addr.sin_port),
    ))
}

/// Serves the SOCKS5 relay until `stop` turns true: each connection the guest made (DNATed
/// here after the policy admitted it) is tunnelled through the policy's `egress_proxy`.
pub async fn serve_socks_relay(
    sb: Arc<EdgeSandbox>,
    listener: TcpListener,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        let conn = tokio::select! {
            c = listener.accept() => c,
            _ = stop.wait_for(|v| *v) => return,
        };
        let Ok((mut guest, _)) = conn else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let Some(permit) = sb.admit() else {
            continue;
        };
        let sb = sb.clone();
        tokio::spawn(async move {
            let policy = sb.policy();
            let dst = match original_dst(&guest) {
                Ok(d) => d,
                Err(e) => {
                    sb.sample(format!("relay: no original destination: {e}"));
                    return;
                }
            };
            if policy.egress_proxy.is_none() || !sb.admits(&policy, *dst.ip()) {
                sb.bump(|s| s.refused_connections += 1);
                return;
            }
            let up =
                tokio::time::timeout(CONNECT_TIMEOUT, sb.connect(&policy, SocketAddr::V4(dst)))
                    .await;
            let mut up = match up {
                Ok(Ok(u)) => u,
                Ok(Err(e)) => {
                    sb.bump(|s| s.failed += 1);
                    sb.sample(format!("{dst}: {e}"));
                    return;
                }
                Err(_) => {
                    sb.bump(|s| s.failed += 1);
                    sb.sample(format!("{dst}: the egress proxy did not answer in time"));
                    return;
                }
            };
            sb.bump(|s| s.relayed += 1);
            let _ = tokio::io::copy_bidirectional(&mut guest, &mut up).await;
            drop(permit);
        });
    }
}

type ProxyBody = BoxBody<Bytes, hyper::Error>;

fn text_body(text: String) -> ProxyBody {
    Full::new(Bytes::from(text))
        .map_err(|never| match never {})
        .boxed()
}

/// A header-safe form of `reason`.
fn header_text(reason: &str) -> String {
    reason
        .chars()
        .map(|c| {
            if c.is_ascii_graphic() || c == ' ' {
                c
            } else {
                '?'
            }
        })
        .take(400)
        .collect()
}

/// The proxy's own 502, counted and sampled.
fn fail(sb: &EdgeSandbox, host: &str, reason: String) -> Response<ProxyBody> {
    tracing::info!("egress proxy {}: {host}: {reason}", sb.name);
    sb.bump(|s| s.failed += 1);
    sb.sample(format!("{host}: {reason}"));
    let mut r = Response::new(text_body(format!("ember egress proxy: {host}: {reason}\n")));
    *r.status_mut() = StatusCode::BAD_GATEWAY;
    if let Ok(v) = hyper::header::HeaderValue::from_str(&header_text(&reason)) {
        r.headers_mut().insert(ERROR_HEADER, v);
    }
    r
}

/// What a listener of the proxy takes: TLS (ended here, for port 443) or plain HTTP (80).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    /// HTTPS: the TLS handshake first, with a leaf for the SNI's rule host.
    Https,
    /// Plain HTTP.
    Http,
}

/// Serves one of the proxy's listeners until `stop` turns true: each admitted connection on
/// a task of its own (at most [`EdgeSandbox::admit`]'s cap at once).
pub async fn serve(
    shared: Arc<EdgeShared>,
    sb: Arc<EdgeSandbox>,
    listener: TcpListener,
    scheme: Scheme,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        let conn = tokio::select! {
            c = listener.accept() => c,
            _ = stop.wait_for(|v| *v) => return,
        };
        let Ok((stream, _)) = conn else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let Some(permit) = sb.admit() else {
            continue;
        };
        let (shared, sb) = (shared.clone(), sb.clone());
        tokio::spawn(async move {
            match scheme {
                Scheme::Https => tls_connection(shared, sb, stream).await,
                Scheme::Http => serve_requests(shared, sb, TokioIo::new(stream), None).await,
            }
            drop(permit);
        });
    }
}

async fn tls_connection(shared: Arc<EdgeShared>, sb: Arc<EdgeSandbox>, stream: TcpStream) {
    let acceptor =
        tokio_rustls::LazyConfigAcceptor::new(rustls::server::Acceptor::default(), stream);
    let Ok(Ok(start)) = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor).await else {
        return;
    };
    let sni = start
        .client_hello()
        .server_name()
        .map(|s| s.trim_end_matches('.').to_ascii_lowercase());
    let host = match sni {
        Some(h) if sb.is_rule_host(&h) => h,
        other => {
            sb.bump(|s| s.refused_connections += 1);
            sb.sample(format!(
                "{}: TLS to a rule host's address with a name that has no rules: refused",
                other.as_deref().unwrap_or("(no server name)")
            ));
            return;
        }
    };
    let cfg = match shared.ca.server_config(&host) {
        Ok(c) => c,
        Err(e) => {
            sb.sample(format!("{host}: {e}"));
            return;
        }
    };
    let Ok(Ok(tls)) = tokio::time::timeout(HANDSHAKE_TIMEOUT, start.into_stream(cfg)).await else {
        return;
    };
    serve_requests(shared, sb, TokioIo::new(tls), Some(host)).await;
}

async fn serve_requests<IO>(
    shared: Arc<EdgeShared>,
    sb: Arc<EdgeSandbox>,
    io: TokioIo<IO>,
    tls_host: Option<String>,
) where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
        let (shared, sb, tls_host) = (shared.clone(), sb.clone(), tls_host.clone());
        async move { Ok::<_, Infallible>(forward(&shared, &sb, req, tls_host).await) }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .serve_connection(io, svc)
        .await;
}

/// The request's host (lower case, no port): `Host`, else the URI's authority.
fn request_host(req: &Request<Incoming>) -> Option<String> {
    let h = req
        .headers()
        .get(hyper::header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .or_else(|| req.uri().authority().map(|a| a.to_string()))?;
    let h = h.rsplit_once(':').map_or(h.as_str(), |(name, port)| {
        if port.bytes().all(|b| b.is_ascii_digit()) {
            name
        } else {
            h.as_str()
        }
    });
    Some(h.trim_end_matches('.').to_ascii_lowercase())
}

async fn forward(
    shared: &EdgeShared,
    sb: &EdgeSandbox,
    mut req: Request<Incoming>,
    tls_host: Option<String>,
) -> Response<ProxyBody> {
    sb.bump(|s| s.requests += 1);
    let asked = request_host(&req);
    let host = match (&tls_host, asked) {
        (Some(t), Some(h)) if &h != t => {
            return fail(
                sb,
                t,
                format!("the request's Host {h:?} is not the TLS server name"),
            )
        }
        (Some(t), _) => t.clone(),
        (None, Some(h)) => h,
        (None, None) => return fail(sb, "?", "the request has no Host".into()),
    };
    let policy = sb.policy();
    let Some(headers) = policy.rule_headers(&host) else {
        return fail(sb, &host, "no rules for this host".into());
    };
    // Every placeholder resolved now (a rotation applies to this request), or no request.
    let mut set = Vec::with_capacity(headers.len());
    for (name, template) in &headers {
        let lookup = |n: &str| shared.secret(n);
        let value = match crate::secrets::resolve(template, &lookup) {
            Ok(v) => v,
            Err(e) => return fail(sb, &host, format!("header {name}: {e}")),
        };
        let (Ok(hn), Ok(mut hv)) = (
            hyper::header::HeaderName::from_bytes(name.as_bytes()),
            hyper::header::HeaderValue::from_str(&value),
        ) else {
            return fail(
                sb,
                &host,
                format!("header {name}: not a valid header after resolution"),
            );
        };
        hv.set_sensitive(true);
        set.push((hn, hv));
    }
    let addrs = match sb.resolver.lookup_v4(&host).await {
        Ok(a) => a,
        Err(e) => return fail(sb, &host, format!("cannot resolve: {e}")),
    };
    let Some(ip) = addrs.iter().copied().find(|ip| sb.admits(&policy, *ip)) else {
        return fail(
            sb,
            &host,
            format!("every address ({addrs:?}) is denied by the policy"),
        );
    };
    let tls = tls_host.is_some();
    let port = if tls { 443 } else { 80 };
    let addr = SocketAddr::from((ip, port));
    let tcp = match tokio::time::timeout(CONNECT_TIMEOUT, sb.connect(&policy, addr)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return fail(sb, &host, format!("cannot connect to {addr}: {e}")),
        Err(_) => return fail(sb, &host, format!("connecting to {addr} timed out")),
    };
    for (n, v) in set {
        req.headers_mut().insert(n, v);
    }
    // Origin form upstream, whatever form the guest used.
    if let Some(pq) = req.uri().path_and_query().cloned() {
        if let Ok(u) = hyper::Uri::builder().path_and_query(pq).build() {
            *req.uri_mut() = u;
        }
    }
    let sent = if tls {
        let Ok(name) = rustls::pki_types::ServerName::try_from(host.clone()) else {
            return fail(sb, &host, "not a valid TLS server name".into());
        };
        let connector = tokio_rustls::TlsConnector::from(shared.client.clone());
        let stream =
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, connector.connect(name, tcp)).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    return fail(sb, &host, format!("upstream TLS ({addr}): {e}"));
                }
                Err(_) => return fail(sb, &host, format!("upstream TLS ({addr}) timed out")),
            };
        send(TokioIo::new(stream), req).await
    } else {
        send(TokioIo::new(tcp), req).await
    };
    match sent {
        Ok(resp) => {
            sb.bump(|s| s.forwarded += 1);
            resp.map(|b| b.boxed())
        }
        Err(e) => fail(sb, &host, format!("upstream HTTP ({addr}): {e}")),
    }
}

async fn send<IO>(io: TokioIo<IO>, req: Request<Incoming>) -> Result<Response<Incoming>, String>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    sender.send_request(req).await.map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failure_reasons_fit_a_header() {
        assert_eq!(header_text("a\r\nb: c"), "a??b: c");
        hyper::header::HeaderValue::from_str(&header_text("x\u{7f}y\u{e9}")).unwrap();
    }
}
