//! The egress proxy's certificate authority: one per runtime home
//! (`$EMBER_HOME/edge-ca/ca.pem`, key `ca.key` mode 0600), created at first use. Sandboxes
//! with rules trust it; it signs, in memory, a leaf for each rule host the proxy terminates.

use std::collections::HashMap;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// Errors of the CA.
#[derive(Debug, thiserror::Error)]
pub enum CaError {
    /// A file.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// rcgen.
    #[error("edge CA: {what}: {source}")]
    Generate {
        /// What was being made.
        what: String,
        /// Why.
        source: rcgen::Error,
    },
    /// rustls refused a certificate or key.
    #[error("edge CA: {0}")]
    Tls(String),
}

/// Validity of the CA (10 years) and of leaves (30 days; they live in memory only).
const CA_DAYS: i64 = 3650;
const LEAF_DAYS: i64 = 30;

/// A local CA's certificate parameters: `name` and a fingerprint of its key as the common
/// name, path length 0 (it signs leaves only). Also the E2B TLS listener's CA
/// (`server/src/e2b/tls.rs`).
pub fn ca_params(key: &rcgen::KeyPair, name: &str) -> rcgen::CertificateParams {
    use sha2::Digest;
    let fp = sha2::Sha256::digest(key.public_key_raw());
    let fp: String = fp[..6].iter().map(|b| format!("{b:02x}")).collect();
    let mut p = rcgen::CertificateParams::default();
    p.distinguished_name = rcgen::DistinguishedName::new();
    p.distinguished_name
        .push(rcgen::DnType::CommonName, format!("{name} {fp}"));
    p.distinguished_name
        .push(rcgen::DnType::OrganizationName, "ember");
    p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Constrained(0));
    p.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    p
}

/// A TLS server leaf's parameters: `names` as subject alternative names, `common_name`, valid
/// from a day ago for `days` days, server authentication only.
pub fn leaf_params(
    names: Vec<String>,
    common_name: &str,
    days: i64,
) -> Result<rcgen::CertificateParams, rcgen::Error> {
    let mut params = rcgen::CertificateParams::new(names)?;
    params.distinguished_name = rcgen::DistinguishedName::new();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, common_name);
    params.is_ca = rcgen::IsCa::ExplicitNoCa;
    params.key_usages = vec![
        rcgen::KeyUsagePurpose::DigitalSignature,
        rcgen::KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    params.use_authority_key_identifier_extension = true;
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::days(1);
    params.not_after = now + time::Duration::days(days);
    Ok(params)
}

/// This CA's name (the common name adds its key's fingerprint).
const CA_NAME: &str = "ember egress proxy CA";

fn gen_err(what: &str) -> impl FnOnce(rcgen::Error) -> CaError + '_ {
    move |source| CaError::Generate {
        what: what.to_string(),
        source,
    }
}

fn write_new(path: &Path, bytes: &[u8], mode: u32) -> Result<(), CaError> {
    let io = |what| {
        let path = path.to_path_buf();
        move |source| CaError::Io { what, path, source }
    };
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(io("cannot create"))?;
    f.write_all(bytes)
        .and_then(|_| f.sync_all())
        .map_err(io("cannot write"))?;
    std::fs::rename(&tmp, path).map_err(io("cannot rename into"))
}

/// The CA, loaded or created.
pub struct EdgeCa {
    key: rcgen::KeyPair,
    /// The CA certificate (PEM), what guests trust.
    pub cert_pem: String,
    leaves: Mutex<HashMap<String, Arc<rustls::ServerConfig>>>,
}

impl std::fmt::Debug for EdgeCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EdgeCa").finish_non_exhaustive()
    }
}

impl EdgeCa {
    /// The CA in `dir` (`ca.pem`, `ca.key`), made when absent.
    pub fn load_or_create(dir: &Path) -> Result<EdgeCa, CaError> {
        let io = |what, path: &Path| {
            let path = path.to_path_buf();
            move |source| CaError::Io { what, path, source }
        };
        std::fs::create_dir_all(dir).map_err(io("cannot create", dir))?;
        let (cert_path, key_path) = (dir.join("ca.pem"), dir.join("ca.key"));
        if cert_path.exists() && key_path.exists() {
            let key_pem =
                std::fs::read_to_string(&key_path).map_err(io("cannot read", &key_path))?;
            let key = rcgen::KeyPair::from_pem(&key_pem).map_err(gen_err("reading ca.key"))?;
            let cert_pem =
                std::fs::read_to_string(&cert_path).map_err(io("cannot read", &cert_path))?;
            return Ok(EdgeCa {
                key,
                cert_pem,
                leaves: Mutex::new(HashMap::new()),
            });
        }
        let key = rcgen::KeyPair::generate().map_err(gen_err("the CA key"))?;
        let mut params = ca_params(&key, CA_NAME);
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::days(1);
        params.not_after = now + time::Duration::days(CA_DAYS);
        let cert = params
            .self_signed(&key)
            .map_err(gen_err("the CA certificate"))?;
        write_new(&key_path, key.serialize_pem().as_bytes(), 0o600)?;
        write_new(&cert_path, cert.pem().as_bytes(), 0o644)?;
        tracing::info!("created the egress proxy CA {}", cert_path.display());
        Ok(EdgeCa {
            key,
            cert_pem: cert.pem(),
            leaves: Mutex::new(HashMap::new()),
        })
    }

    /// A TLS server configuration with a leaf for `host` (issued once, then cached).
    pub fn server_config(&self, host: &str) -> Result<Arc<rustls::ServerConfig>, CaError> {
        let mut leaves = self.leaves.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = leaves.get(host) {
            return Ok(c.clone());
        }
        let key = rcgen::KeyPair::generate().map_err(gen_err("a leaf key"))?;
        let params = leaf_params(vec![host.to_string()], host, LEAF_DAYS)
            .map_err(gen_err(&format!("a leaf for {host}")))?;
        let issuer = rcgen::Issuer::new(ca_params(&self.key, CA_NAME), &self.key);
        let cert = params
            .signed_by(&key, &issuer)
            .map_err(gen_err(&format!("a leaf for {host}")))?;
        let chain = vec![CertificateDer::from(cert.der().to_vec())];
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let mut cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| CaError::Tls(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| CaError::Tls(e.to_string()))?;
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        let cfg = Arc::new(cfg);
        leaves.insert(host.to_string(), cfg.clone());
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ca_persists_and_issues_leaves_per_host() {
        let d = tempfile::tempdir().unwrap();
        let a = EdgeCa::load_or_create(d.path()).unwrap();
        let b = EdgeCa::load_or_create(d.path()).unwrap();
        assert_eq!(a.cert_pem, b.cert_pem);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(d.path().join("ca.key"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let c1 = a.server_config("api.example.com").unwrap();
        let c2 = a.server_config("api.example.com").unwrap();
        assert!(Arc::ptr_eq(&c1, &c2));
    }
}
