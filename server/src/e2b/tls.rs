//! The optional TLS listener of `ember serve` and the local CA / `*.<domain>` certificate it
//! uses.
//!
//! Outside debug mode the E2B SDKs only speak https to `https://api.<domain>` and
//! `https://<port>-<sandboxID>.<domain>` (docs/e2b.md, "option C"). To serve that on one
//! machine without a public certificate, ember makes a local CA once and issues a leaf
//! certificate for `*.<domain>` and `<domain>` from it; clients trust the CA through
//! `SSL_CERT_FILE` (a bundle of the system CAs plus ember's, written by `ember tls init`).
//!
//! Files in the TLS directory (normally `$EMBER_HOME/tls`):
//!
//! | file | what | mode |
//! |---|---|---|
//! | `ca.pem` | the local CA's certificate (ECDSA P-256, 10 years) | 0644 |
//! | `ca-key.pem` | its private key | 0600 |
//! | `cert.pem` | the leaf certificate, then the CA's (the chain the server sends) | 0644 |
//! | `key.pem` | the leaf's private key | 0600 |
//! | `bundle.pem` | system CAs + `ca.pem`, for `SSL_CERT_FILE` ([`write_bundle`]) | 0644 |
//!
//! The CA is never replaced once made (users may have installed it); the leaf is re-issued,
//! with a fresh key, when it does not verify against the CA for the requested domain, or
//! expires within [`RENEW_BEFORE`].
//!
//! A bare single-label domain (`localhost`) is refused: webpki-based clients (the Python SDK's
//! pyqwest/rustls) reject a `*.localhost` wildcard ("certificate not valid for name"). Use a
//! name below it, e.g. `e2b.localhost`, which the SDKs' own resolvers map to loopback.

use std::future::Future;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use rustls::client::danger::ServerCertVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};

use ember_runtime::netpolicy::edge::ca::{ca_params, leaf_params};

/// How long before its expiry the leaf certificate is re-issued.
pub const RENEW_BEFORE: Duration = Duration::from_secs(30 * 86_400);
/// The leaf certificate's lifetime.
const LEAF_DAYS: i64 = 397;
/// The CA's lifetime.
const CA_DAYS: i64 = 3650;
/// The CA's subject common name (followed by a fingerprint of its key).
const CA_NAME: &str = "ember local CA";
/// A TLS handshake that has not completed after this long is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// The system CA bundle on Debian.
pub const SYSTEM_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// What went wrong with the TLS files or the listener's settings.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The domain is not usable as a certificate name.
    #[error("TLS domain {domain:?}: {reason}")]
    Domain {
        /// The domain as given.
        domain: String,
        /// Why it is refused.
        reason: String,
    },
    /// A file could not be read, written or created.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// A PEM file holds nothing usable.
    #[error("{}: {what}", path.display())]
    Pem {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        what: String,
    },
    /// Only one of `ca.pem` / `ca-key.pem` exists.
    #[error(
        "{} exists but {} does not: the local CA is incomplete (remove both to make a new \
         CA; clients that trusted the old one must then trust the new one)",
        present.display(),
        missing.display()
    )]
    IncompleteCa {
        /// The file that exists.
        present: PathBuf,
        /// The file that is missing.
        missing: PathBuf,
    },
    /// Generating a key or certificate failed.
    #[error("cannot generate {what}: {source}")]
    Generate {
        /// Which key or certificate.
        what: &'static str,
        /// rcgen's error.
        source: rcgen::Error,
    },
    /// A freshly issued certificate does not verify against the CA.
    #[error(
        "the certificate just issued into {} does not verify against {} for {name}: {reason} \
         (was the CA made by another program? remove the directory to start over)",
        cert.display(),
        ca.display()
    )]
    Verify {
        /// The leaf certificate.
        cert: PathBuf,
        /// The CA certificate.
        ca: PathBuf,
        /// The name checked.
        name: String,
        /// webpki's verdict.
        reason: String,
    },
    /// rustls refused the certificate or key.
    #[error("TLS settings from {} and {}: {source}", cert.display(), key.display())]
    Config {
        /// The certificate chain file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// rustls' error.
        source: rustls::Error,
    },
}

/// The files the TLS listener uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The local CA's certificate (what clients trust).
    pub ca_cert: PathBuf,
    /// The leaf certificate chain (leaf, then CA).
    pub cert: PathBuf,
    /// The leaf's private key.
    pub key: PathBuf,
}

impl TlsFiles {
    /// The file names in `dir`.
    pub fn in_dir(dir: &Path) -> TlsFiles {
        TlsFiles {
            ca_cert: dir.join("ca.pem"),
            cert: dir.join("cert.pem"),
            key: dir.join("key.pem"),
        }
    }
}

/// The CA key's file in `dir`.
fn ca_key_path(dir: &Path) -> PathBuf {
    dir.join("ca-key.pem")
}

/// `domain` without a `:port` suffix, lower-cased, checked to be a DNS name of at least two
/// labels (so that `*.<domain>` is a wildcard TLS clients accept).
pub fn cert_domain(domain: &str) -> Result<String, TlsError> {
    let bad = |reason: &str| TlsError::Domain {
        domain: domain.to_string(),
        reason: reason.to_string(),
    };
    let mut d = domain.trim();
    if let Some((host, port)) = d.rsplit_once(':') {
        if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad("expected a host name, optionally with :PORT"));
        }
        d = host;
    }
    let d = d.trim_end_matches('.').to_ascii_lowercase();
    if d.is_empty() {
        return Err(bad("empty host name"));
    }
    if d.parse::<std::net::IpAddr>().is_ok() {
        return Err(bad(
            "an IP address cannot have sandbox subdomains; use a name such as e2b.localhost",
        ));
    }
    if !d.contains('.') {
        return Err(bad(&format!(
            "a wildcard for a single-label name (*.{d}) is rejected by TLS clients; use a name \
             below it, such as e2b.{d}"
        )));
    }
    if ServerName::try_from(format!("x.{d}")).is_err()
        || !d
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
    {
        return Err(bad("not a valid DNS name"));
    }
    Ok(d)
}

/// Loads the TLS files in `dir` for `domain` (`host` or `host:port`), making what is missing:
/// the local CA once, and the leaf certificate for `*.<host>` and `<host>` when it is absent,
/// made for another name or by another CA, or expires within [`RENEW_BEFORE`].
pub fn load_or_create(dir: &Path, domain: &str) -> Result<TlsFiles, TlsError> {
    let domain = cert_domain(domain)?;
    create_private_dir(dir)?;
    let files = TlsFiles::in_dir(dir);
    let ca_key_file = ca_key_path(dir);
    let ca_key = match (files.ca_cert.exists(), ca_key_file.exists()) {
        (true, true) => {
            let pem = read_string(&ca_key_file)?;
            rcgen::KeyPair::from_pem(&pem).map_err(|e| TlsError::Pem {
                path: ca_key_file.clone(),
                what: format!("not a usable private key: {e}"),
            })?
        }
        (false, false) => create_ca(&files.ca_cert, &ca_key_file)?,
        (true, false) => {
            return Err(TlsError::IncompleteCa {
                present: files.ca_cert.clone(),
                missing: ca_key_file,
            })
        }
        (false, true) => {
            return Err(TlsError::IncompleteCa {
                present: ca_key_file,
                missing: files.ca_cert.clone(),
            })
        }
    };
    let renew_at = SystemTime::now() + RENEW_BEFORE;
    if files.cert.exists() && files.key.exists() && verify_leaf(&files, &domain, renew_at).is_ok() {
        return Ok(files);
    }
    issue_leaf(&files, &ca_key, &domain)?;
    if let Err(reason) = verify_leaf(&files, &domain, SystemTime::now()) {
        return Err(TlsError::Verify {
            cert: files.cert.clone(),
            ca: files.ca_cert.clone(),
            name: domain,
            reason,
        });
    }
    Ok(files)
}

/// Makes the CA's key and self-signed certificate; returns the key.
fn create_ca(cert_path: &Path, key_path: &Path) -> Result<rcgen::KeyPair, TlsError> {
    let key = rcgen::KeyPair::generate().map_err(|source| TlsError::Generate {
        what: "the CA key",
        source,
    })?;
    let mut params = ca_params(&key, CA_NAME);
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::days(1);
    params.not_after = now + time::Duration::days(CA_DAYS);
    let cert = params
        .self_signed(&key)
        .map_err(|source| TlsError::Generate {
            what: "the CA certificate",
            source,
        })?;
    // The key first: a CA certificate without its key is the inconsistent state.
    write_atomic(key_path, key.serialize_pem().as_bytes(), 0o600)?;
    write_atomic(cert_path, cert.pem().as_bytes(), 0o644)?;
    Ok(key)
}

/// Issues a leaf for `*.<domain>` and `<domain>` with a fresh key.
fn issue_leaf(files: &TlsFiles, ca_key: &rcgen::KeyPair, domain: &str) -> Result<(), TlsError> {
    let key = rcgen::KeyPair::generate().map_err(|source| TlsError::Generate {
        what: "the certificate key",
        source,
    })?;
    let params = leaf_params(
        vec![format!("*.{domain}"), domain.to_string()],
        &format!("*.{domain}"),
        LEAF_DAYS,
    )
    .map_err(|source| TlsError::Generate {
        what: "the certificate's names",
        source,
    })?;
    let issuer = rcgen::Issuer::new(ca_params(ca_key, CA_NAME), ca_key);
    let cert = params
        .signed_by(&key, &issuer)
        .map_err(|source| TlsError::Generate {
            what: "the certificate",
            source,
        })?;
    let ca_pem = read_string(&files.ca_cert)?;
    let chain = format!("{}{}", cert.pem(), ca_pem);
    write_atomic(&files.key, key.serialize_pem().as_bytes(), 0o600)?;
    write_atomic(&files.cert, chain.as_bytes(), 0o644)?;
    Ok(())
}

/// Checks that the leaf in `files.cert` chains to `files.ca_cert`, is valid at `at`, and
/// names both `<domain>` and a host below it. The reason is webpki's verdict.
fn verify_leaf(files: &TlsFiles, domain: &str, at: SystemTime) -> Result<(), String> {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(&files.ca_cert).map_err(|e| e.to_string())? {
        roots
            .add(c.map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
    }
    let chain = CertificateDer::pem_file_iter(&files.cert)
        .map_err(|e| e.to_string())?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    let Some((leaf, rest)) = chain.split_first() else {
        return Err("no certificate in the file".into());
    };
    // The key must parse too, or the listener would fail later.
    PrivateKeyDer::from_pem_file(&files.key).map_err(|e| e.to_string())?;
    let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
        Arc::new(roots),
        Arc::new(rustls::crypto::ring::default_provider()),
    )
    .build()
    .map_err(|e| e.to_string())?;
    let secs = at
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    for name in [format!("49983-probe.{domain}"), domain.to_string()] {
        let sn = ServerName::try_from(name).map_err(|e| e.to_string())?;
        verifier
            .verify_server_cert(leaf, rest, &sn, &[], UnixTime::since_unix_epoch(secs))
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// The rustls server settings for `files`: the chain in `files.cert`, the key in `files.key`,
/// ALPN `h2` then `http/1.1`, ring as the crypto provider.
pub fn server_config(files: &TlsFiles) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let pem_err = |path: &Path, e: rustls::pki_types::pem::Error| TlsError::Pem {
        path: path.to_path_buf(),
        what: e.to_string(),
    };
    let chain = CertificateDer::pem_file_iter(&files.cert)
        .map_err(|e| pem_err(&files.cert, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_err(&files.cert, e))?;
    if chain.is_empty() {
        return Err(TlsError::Pem {
            path: files.cert.clone(),
            what: "no CERTIFICATE section".into(),
        });
    }
    let key = PrivateKeyDer::from_pem_file(&files.key).map_err(|e| pem_err(&files.key, e))?;
    let config_err = |source| TlsError::Config {
        cert: files.cert.clone(),
        key: files.key.clone(),
        source,
    };
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(config_err)?
    .with_no_client_auth()
    .with_single_cert(chain, key)
    .map_err(config_err)?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Writes `bundle.pem` in `dir`: the system CAs (`system`, normally [`SYSTEM_CA_BUNDLE`]; left
/// out when absent) followed by ember's `ca.pem`, for `SSL_CERT_FILE` (which replaces the
/// system bundle for OpenSSL- and rustls-based clients). Returns its path and whether the
/// system bundle was found.
pub fn write_bundle(dir: &Path, system: &Path) -> Result<(PathBuf, bool), TlsError> {
    let files = TlsFiles::in_dir(dir);
    let ca = read_string(&files.ca_cert)?;
    let (mut out, found) = match std::fs::read_to_string(system) {
        Ok(s) => (s, true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => (String::new(), false),
        Err(source) => {
            return Err(TlsError::Io {
                path: system.to_path_buf(),
                source,
            })
        }
    };
    if !out.is_empty() && !out.ends_with('\n') {
        out.push('\n');
    }
    out.push_str("# ember local CA\n");
    out.push_str(&ca);
    let path = dir.join("bundle.pem");
    write_atomic(&path, out.as_bytes(), 0o644)?;
    Ok((path, found))
}

fn read_string(path: &Path) -> Result<String, TlsError> {
    std::fs::read_to_string(path).map_err(|source| TlsError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Creates `dir` (and parents); a directory this creates is mode 0700.
fn create_private_dir(dir: &Path) -> Result<(), TlsError> {
    if dir.is_dir() {
        return Ok(());
    }
    let io = |source| TlsError::Io {
        path: dir.to_path_buf(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(io)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(io)
}

/// Writes `data` to `path` through a temporary file in the same directory (created with
/// `mode`, so a key is never readable by others), then renames it into place.
fn write_atomic(path: &Path, data: &[u8], mode: u32) -> Result<(), TlsError> {
    let io = |source| TlsError::Io {
        path: path.to_path_buf(),
        source,
    };
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("tls");
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let result = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)?;
        f.write_all(data)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(io)
}

/// Logs failed TLS handshakes at most [`HandshakeLog::BURST`] times per minute, then a count
/// of those left out: a scanner or a client that does not trust the CA must not flood the log.
#[derive(Debug)]
struct HandshakeLog {
    state: Mutex<(Instant, u32, u64)>,
}

impl HandshakeLog {
    const BURST: u32 = 10;
    const WINDOW: Duration = Duration::from_secs(60);

    fn new() -> Self {
        HandshakeLog {
            state: Mutex::new((Instant::now(), 0, 0)),
        }
    }

    fn failed(&self, peer: std::net::SocketAddr, what: &dyn std::fmt::Display) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let (start, logged, suppressed) = &mut *st;
        if start.elapsed() >= Self::WINDOW {
            if *suppressed > 0 {
                tracing::warn!(
                    "{suppressed} more TLS handshake failures in the last {:?} not logged",
                    Self::WINDOW
                );
            }
            *start = Instant::now();
            *logged = 0;
            *suppressed = 0;
        }
        if *logged < Self::BURST {
            *logged += 1;
            tracing::warn!("TLS handshake with {peer} failed: {what}");
        } else {
            *suppressed += 1;
        }
    }
}

/// Serves `app` over TLS on `listener` until `stop` completes: each connection does the TLS
/// handshake (at most 10 s), then HTTP/1.1 or HTTP/2 (hyper-util's auto builder; ALPN offers
/// both) with `TCP_NODELAY`. A failed handshake is logged (rate-limited) and the loop goes on.
///
/// Requests get an `axum::extract::ConnectInfo<SocketAddr>` extension with the peer, and,
/// for HTTP/2 (which carries the host in `:authority`, not in a `Host` header), a `Host`
/// header copied from the URI's authority, so that routing on `Host` works for both.
///
/// On `stop` the listener closes, idle connections close, and open requests may finish;
/// this returns when the last connection has ended (bound it with a timeout if streams may
/// stay open).
pub async fn serve_tls(
    listener: tokio::net::TcpListener,
    config: Arc<rustls::ServerConfig>,
    app: axum::Router,
    stop: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let log = Arc::new(HandshakeLog::new());
    let mut stop = std::pin::pin!(stop);
    loop {
        let (tcp, peer) = tokio::select! {
            _ = &mut stop => break,
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) if is_transient_accept_error(&e) => {
                    // Out of descriptors or an aborted connection: back off, keep serving.
                    tracing::warn!("TLS listener: accept: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
                Err(e) => return Err(e),
            },
        };
        let _ = tcp.set_nodelay(true);
        let acceptor = acceptor.clone();
        let app = app.clone();
        let log = log.clone();
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => return log.failed(peer, &e),
                Err(_) => return log.failed(peer, &"timed out"),
            };
            let service = hyper::service::service_fn(move |mut req: hyper::Request<_>| {
                req.extensions_mut()
                    .insert(axum::extract::ConnectInfo(peer));
                if !req.headers().contains_key(hyper::header::HOST) {
                    let host = req
                        .uri()
                        .authority()
                        .and_then(|a| hyper::header::HeaderValue::from_str(a.as_str()).ok());
                    if let Some(h) = host {
                        req.headers_mut().insert(hyper::header::HOST, h);
                    }
                }
                tower::ServiceExt::oneshot(app.clone(), req)
            });
            let builder =
                hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new());
            let conn =
                builder.serve_connection_with_upgrades(hyper_util::rt::TokioIo::new(tls), service);
            if let Err(e) = watcher.watch(conn).await {
                tracing::debug!("TLS connection from {peer}: {e}");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// Accept errors that concern one connection or a passing shortage, not the listener.
fn is_transient_accept_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionAborted | ConnectionReset | ConnectionRefused | Interrupted | WouldBlock
    ) || matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn domains_are_checked_and_ports_stripped() {
        assert_eq!(cert_domain("e2b.localhost:3443").unwrap(), "e2b.localhost");
        assert_eq!(cert_domain("E2B.Example.COM").unwrap(), "e2b.example.com");
        for bad in [
            "localhost",
            "localhost:3443",
            "127.0.0.1:3443",
            "",
            "a b.c",
            "x.y:",
        ] {
            assert!(cert_domain(bad).is_err(), "{bad:?} accepted");
        }
        let e = cert_domain("localhost").unwrap_err().to_string();
        assert!(e.contains("e2b.localhost"), "{e}");
    }

    #[test]
    fn files_are_made_once_and_reissued_for_another_domain() {
        let dir = tempfile::tempdir().unwrap();
        let tls = dir.path().join("tls");
        let f = load_or_create(&tls, "e2b.localhost:3443").unwrap();
        assert_eq!(f, TlsFiles::in_dir(&tls));
        assert_eq!(mode(&f.key), 0o600);
        assert_eq!(mode(&ca_key_path(&tls)), 0o600);
        assert_eq!(mode(&tls), 0o700);
        let ca = std::fs::read(&f.ca_cert).unwrap();
        let leaf = std::fs::read(&f.cert).unwrap();
        // Same domain (another port): nothing changes.
        load_or_create(&tls, "e2b.localhost:4000").unwrap();
        assert_eq!(std::fs::read(&f.cert).unwrap(), leaf);
        // Another domain: a new leaf from the same CA.
        load_or_create(&tls, "sbx.example.test").unwrap();
        assert_ne!(std::fs::read(&f.cert).unwrap(), leaf);
        assert_eq!(std::fs::read(&f.ca_cert).unwrap(), ca);
        assert!(verify_leaf(&f, "sbx.example.test", SystemTime::now()).is_ok());
        assert!(verify_leaf(&f, "e2b.localhost", SystemTime::now()).is_err());
        // Near expiry: re-issued.
        let late = SystemTime::now() + Duration::from_secs((LEAF_DAYS as u64 + 1) * 86_400);
        assert!(verify_leaf(&f, "sbx.example.test", late).is_err());
        // A corrupt leaf is replaced; a CA without its key is an error naming both files.
        std::fs::write(&f.cert, "junk").unwrap();
        load_or_create(&tls, "sbx.example.test").unwrap();
        assert!(verify_leaf(&f, "sbx.example.test", SystemTime::now()).is_ok());
        std::fs::remove_file(ca_key_path(&tls)).unwrap();
        let e = load_or_create(&tls, "sbx.example.test")
            .unwrap_err()
            .to_string();
        assert!(e.contains("ca-key.pem") && e.contains("ca.pem"), "{e}");
    }

    #[test]
    fn bundle_is_system_cas_then_ours() {
        let dir = tempfile::tempdir().unwrap();
        let f = load_or_create(dir.path(), "e2b.localhost").unwrap();
        let sys = dir.path().join("system.pem");
        std::fs::write(&sys, "SYSTEM").unwrap();
        let (p, found) = write_bundle(dir.path(), &sys).unwrap();
        assert!(found);
        let b = std::fs::read_to_string(&p).unwrap();
        assert!(b.starts_with("SYSTEM\n"), "{b}");
        assert!(b.ends_with(&std::fs::read_to_string(&f.ca_cert).unwrap()));
        let (_, found) = write_bundle(dir.path(), &dir.path().join("absent")).unwrap();
        assert!(!found);
    }

    /// Handshake with a client that trusts only `ca.pem`, for `name`; then one HTTP/1.1
    /// request. Returns the response text.
    async fn fetch(
        addr: std::net::SocketAddr,
        ca: &Path,
        name: &str,
        alpn: &[u8],
    ) -> Result<String, String> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_file_iter(ca).unwrap() {
            roots.add(c.unwrap()).unwrap();
        }
        let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        cfg.alpn_protocols = vec![alpn.to_vec()];
        let connector = tokio_rustls::TlsConnector::from(Arc::new(cfg));
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let sn = ServerName::try_from(name.to_string()).unwrap();
        let mut tls = connector
            .connect(sn, tcp)
            .await
            .map_err(|e| e.to_string())?;
        assert_eq!(tls.get_ref().1.alpn_protocol(), Some(alpn));
        if alpn == b"h2" {
            let (mut send, conn) = hyper::client::conn::http2::handshake(
                hyper_util::rt::TokioExecutor::new(),
                hyper_util::rt::TokioIo::new(tls),
            )
            .await
            .map_err(|e| e.to_string())?;
            tokio::spawn(conn);
            let req = hyper::Request::get(format!("https://{name}/"))
                .body(http_body_util::Empty::<bytes::Bytes>::new())
                .unwrap();
            let resp = send.send_request(req).await.map_err(|e| e.to_string())?;
            let body = http_body_util::BodyExt::collect(resp.into_body())
                .await
                .map_err(|e| e.to_string())?
                .to_bytes();
            return Ok(String::from_utf8_lossy(&body).into_owned());
        }
        tls.write_all(
            format!("GET / HTTP/1.1\r\nHost: {name}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        tls.read_to_end(&mut out).await.map_err(|e| e.to_string())?;
        Ok(String::from_utf8_lossy(&out).into_owned())
    }

    #[tokio::test]
    async fn handshake_succeeds_for_sandbox_hosts_and_fails_for_other_names() {
        let dir = tempfile::tempdir().unwrap();
        let files = load_or_create(dir.path(), "e2b.localhost:1").unwrap();
        let config = server_config(&files).unwrap();
        assert_eq!(
            config.alpn_protocols,
            vec![b"h2".to_vec(), b"http/1.1".to_vec()]
        );
        // The handler answers with the Host header and the peer it was given.
        let app = axum::Router::new().route(
            "/",
            axum::routing::get(
                |headers: hyper::HeaderMap,
                 axum::extract::ConnectInfo(peer): axum::extract::ConnectInfo<
                    std::net::SocketAddr,
                >| async move {
                    format!(
                        "host={} peer-ip={}",
                        headers
                            .get("host")
                            .and_then(|h| h.to_str().ok())
                            .unwrap_or("-"),
                        peer.ip()
                    )
                },
            ),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve_tls(listener, config, app, async {
            let _ = rx.await;
        }));

        let ok = fetch(addr, &files.ca_cert, "49983-abc.e2b.localhost", b"http/1.1")
            .await
            .unwrap();
        assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
        assert!(
            ok.contains("host=49983-abc.e2b.localhost peer-ip=127.0.0.1"),
            "{ok}"
        );
        // HTTP/2: the host arrives as :authority and is given to the app as Host.
        let h2 = fetch(addr, &files.ca_cert, "api.e2b.localhost", b"h2")
            .await
            .unwrap();
        assert_eq!(h2, "host=api.e2b.localhost peer-ip=127.0.0.1");
        // The bare domain is named too.
        fetch(addr, &files.ca_cert, "e2b.localhost", b"http/1.1")
            .await
            .unwrap();
        // Other names: the client refuses the certificate; the server goes on serving.
        for other in ["49983-abc.other.localhost", "a.b.e2b.localhost"] {
            let e = fetch(addr, &files.ca_cert, other, b"http/1.1")
                .await
                .unwrap_err();
            assert!(e.contains("not valid for name"), "{other}: {e}");
        }
        // A client that does not trust the CA at all.
        let stranger = tempfile::tempdir().unwrap();
        let other_ca = load_or_create(stranger.path(), "e2b.localhost").unwrap();
        let e = fetch(
            addr,
            &other_ca.ca_cert,
            "49983-abc.e2b.localhost",
            b"http/1.1",
        )
        .await
        .unwrap_err();
        assert!(
            e.contains("UnknownIssuer") || e.contains("unknown issuer"),
            "{e}"
        );
        // A client that is not TLS at all.
        {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
            let mut buf = Vec::new();
            let _ = s.read_to_end(&mut buf).await;
        }
        fetch(addr, &files.ca_cert, "49983-abc.e2b.localhost", b"http/1.1")
            .await
            .unwrap();

        tx.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .expect("serve_tls stops")
            .unwrap()
            .unwrap();
        assert!(tokio::net::TcpStream::connect(addr).await.is_err());
    }
}
