//! The Docker Registry HTTP API v2 (OCI distribution) client: manifest (by tag or digest,
//! index → linux/amd64), config and layer blobs into the [`BlobStore`], each verified against
//! its digest; a pinned reference's manifest is verified too, and a tag's against the
//! registry's `Docker-Content-Digest`.
//!
//! Auth: an anonymous request first; on `401` the `WWW-Authenticate` challenge is followed —
//! `Bearer` (a token from the realm, with the user's credentials when there are some) or
//! `Basic`. Credentials come from the first auth file that has the registry:
//! `$REGISTRY_AUTH_FILE`, `$XDG_RUNTIME_DIR/containers/auth.json`,
//! `~/.config/containers/auth.json`, `$DOCKER_CONFIG/config.json`, `~/.docker/config.json`
//! (`auths.<host>.auth` = base64 of `user:password`; credential helpers are not run).
//!
//! The host's proxy variables are used for HTTPS registries; a redirect (blobs served from a CDN
//! or an object store) keeps the registry's token only on the same host.
//!
//! HTTPS always, except for loopback registries (`localhost`, `127.0.0.0/8`, `[::1]`) and the
//! hosts listed in `$EMBER_INSECURE_REGISTRIES` (comma-separated `host[:port]`).

use std::io::Read;
use std::path::PathBuf;
use std::time::Duration;

use base64::Engine as _;

use crate::reference::{RegistryRef, DOCKER_HUB};
use crate::source::{resolve, short};
use crate::spec::{media, Descriptor, Digest, MAX_DOCUMENT};
use crate::store::BlobStore;
use crate::{OciError, Progress, PulledImage};

/// Pulls `r` into the store.
pub fn pull(
    r: &RegistryRef,
    store: &BlobStore,
    progress: Progress,
) -> Result<PulledImage, OciError> {
    let mut c = Client::new(r);
    progress(format!("pulling {r} ({})", c.base));
    let reference = r.reference();
    let accept = [
        media::OCI_INDEX,
        media::OCI_MANIFEST,
        media::DOCKER_LIST,
        media::DOCKER_MANIFEST,
    ]
    .join(", ");
    let resp = c.get(
        &format!("/v2/{}/manifests/{reference}", r.repository),
        &accept,
    )?;
    let header = resp.header("Docker-Content-Digest").map(str::to_string);
    let bytes = read_capped(resp, MAX_DOCUMENT, &c.registry)?;
    let digest = Digest::of(&bytes);
    if let Some(pinned) = &r.digest {
        pinned.verify(&format!("{r}: manifest"), &bytes)?;
    } else if let Some(h) = header.and_then(|h| Digest::parse(&h).ok()) {
        h.verify(&format!("{r}: manifest (Docker-Content-Digest)"), &bytes)?;
    }
    progress(format!("manifest {}", short(&digest)));
    let repo = r.repository.clone();
    let mut fetch = |d: &Descriptor, max: u64| -> Result<(), OciError> {
        if store.has(&d.digest) {
            return Ok(());
        }
        if d.size > max {
            return Err(OciError::TooLarge {
                layer: format!("{r}: blob {}", d.digest),
                message: format!("{} bytes is over the cap of {max}", d.size),
            });
        }
        let is_manifest = [
            media::OCI_MANIFEST,
            media::OCI_INDEX,
            media::DOCKER_MANIFEST,
            media::DOCKER_LIST,
        ]
        .contains(&d.media_type.as_str());
        let (path, acc) = if is_manifest {
            (format!("/v2/{repo}/manifests/{}", d.digest), accept.clone())
        } else {
            (format!("/v2/{repo}/blobs/{}", d.digest), "*/*".to_string())
        };
        let resp = c.get(&path, &acc)?;
        let mut body = resp.into_reader().take(max + 1);
        store.put(
            &format!("{r}: blob {}", d.digest),
            &d.digest,
            &mut body,
            max,
        )?;
        Ok(())
    };
    let mut img = resolve(
        &r.to_string(),
        bytes,
        Some(digest),
        store,
        &mut fetch,
        progress,
    )?;
    img.reference = r.to_string();
    Ok(img)
}

fn read_capped(resp: ureq::Response, max: u64, registry: &str) -> Result<Vec<u8>, OciError> {
    let mut out = Vec::new();
    resp.into_reader()
        .take(max + 1)
        .read_to_end(&mut out)
        .map_err(|e| OciError::Registry {
            registry: registry.into(),
            message: format!("reading a response: {e}"),
        })?;
    if out.len() as u64 > max {
        return Err(OciError::Registry {
            registry: registry.into(),
            message: format!("a document larger than {max} bytes"),
        });
    }
    Ok(out)
}

/// Whether `host[:port]` is spoken to over plain HTTP.
pub fn insecure(registry: &str) -> bool {
    let host = match registry.rsplit_once(':') {
        Some((h, p)) if p.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => registry,
    };
    if host == "localhost" || host == "[::1]" || host.starts_with("127.") {
        return true;
    }
    std::env::var("EMBER_INSECURE_REGISTRIES")
        .map(|v| {
            v.split(',')
                .any(|h| h.trim() == registry || h.trim() == host)
        })
        .unwrap_or(false)
}

struct Client {
    agent: ureq::Agent,
    registry: String,
    base: String,
    repository: String,
    credentials: Option<(String, String)>,
    authorization: Option<String>,
}

impl Client {
    fn new(r: &RegistryRef) -> Client {
        let plain = insecure(&r.registry);
        let scheme = if plain { "http" } else { "https" };
        Client {
            agent: ureq::AgentBuilder::new()
                .timeout_connect(Duration::from_secs(30))
                .timeout_read(Duration::from_secs(300))
                .redirects(5)
                // Blob downloads are often redirected to a CDN or an object store: the
                // registry's token goes to the registry's host only.
                .redirect_auth_headers(ureq::RedirectAuthHeaders::SameHost)
                // The host's proxy settings (HTTPS_PROXY, ...) for real registries; loopback
                // and listed plain-HTTP registries are reached directly.
                .try_proxy_from_env(!plain)
                .build(),
            registry: r.registry.clone(),
            base: format!("{scheme}://{}", r.registry),
            repository: r.repository.clone(),
            credentials: credentials(&r.registry),
            authorization: None,
        }
    }

    fn err(&self, message: String) -> OciError {
        OciError::Registry {
            registry: self.registry.clone(),
            message,
        }
    }

    fn get(&mut self, path: &str, accept: &str) -> Result<ureq::Response, OciError> {
        for attempt in 0..2 {
            let mut req = self
                .agent
                .get(&format!("{}{path}", self.base))
                .set("Accept", accept);
            if let Some(a) = &self.authorization {
                req = req.set("Authorization", a);
            }
            match req.call() {
                Ok(resp) => return Ok(resp),
                Err(ureq::Error::Status(401, resp)) if attempt == 0 => {
                    let challenge = resp.header("WWW-Authenticate").unwrap_or("").to_string();
                    self.authenticate(&challenge)?;
                }
                Err(ureq::Error::Status(code, resp)) => {
                    let mut body = String::new();
                    let _ = resp.into_reader().take(400).read_to_string(&mut body);
                    let hint = match code {
                        401 | 403 => " (check the credentials in your auth file: `docker login` or `podman login`)",
                        404 => " (no such repository, tag or blob)",
                        _ => "",
                    };
                    return Err(self.err(format!("GET {path}: HTTP {code}{hint}: {}", body.trim())));
                }
                Err(e) => return Err(self.err(format!("GET {path}: {e}"))),
            }
        }
        Err(self.err(format!(
            "GET {path}: still unauthorised after authenticating (check your credentials)"
        )))
    }

    fn authenticate(&mut self, challenge: &str) -> Result<(), OciError> {
        let (scheme, params) = challenge.split_once(' ').unwrap_or((challenge, ""));
        let basic = self.credentials.as_ref().map(|(u, p)| {
            format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(format!("{u}:{p}"))
            )
        });
        if scheme.eq_ignore_ascii_case("basic") {
            self.authorization = Some(basic.ok_or_else(|| {
                self.err(
                    "the registry wants a login and no auth file has credentials for it".into(),
                )
            })?);
            return Ok(());
        }
        if !scheme.eq_ignore_ascii_case("bearer") {
            return Err(self.err(format!(
                "unsupported authentication challenge {challenge:?}"
            )));
        }
        let p = challenge_params(params);
        let realm = p
            .iter()
            .find(|(k, _)| k == "realm")
            .map(|(_, v)| v.clone())
            .ok_or_else(|| self.err(format!("bearer challenge without a realm: {challenge:?}")))?;
        let mut req = self.agent.get(&realm);
        if let Some((_, s)) = p.iter().find(|(k, _)| k == "service") {
            req = req.query("service", s);
        }
        let scope = p
            .iter()
            .find(|(k, _)| k == "scope")
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| format!("repository:{}:pull", self.repository));
        req = req.query("scope", &scope);
        if let Some(b) = &basic {
            req = req.set("Authorization", b);
        }
        let resp = req
            .call()
            .map_err(|e| self.err(format!("token request to {realm}: {e}")))?;
        let body = read_capped(resp, 1 << 20, &self.registry)?;
        let v: serde_json::Value = serde_json::from_slice(&body)
            .map_err(|e| self.err(format!("token response from {realm}: {e}")))?;
        let token = v
            .get("token")
            .or_else(|| v.get("access_token"))
            .and_then(|t| t.as_str())
            .ok_or_else(|| self.err(format!("token response from {realm} has no token")))?;
        self.authorization = Some(format!("Bearer {token}"));
        Ok(())
    }
}

/// `k="v", k2="v2"` of a challenge.
fn challenge_params(s: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = s.trim();
    while !rest.is_empty() {
        let Some((k, after)) = rest.split_once('=') else {
            break;
        };
        let k = k.trim().trim_start_matches(',').trim().to_ascii_lowercase();
        let (v, after) = if let Some(q) = after.strip_prefix('"') {
            match q.find('"') {
                Some(i) => (q[..i].to_string(), &q[i + 1..]),
                None => (q.to_string(), ""),
            }
        } else {
            match after.find(',') {
                Some(i) => (after[..i].to_string(), &after[i..]),
                None => (after.to_string(), ""),
            }
        };
        out.push((k, v));
        rest = after.trim_start_matches([',', ' ']);
    }
    out
}

/// The auth files, in the order they are consulted.
pub fn auth_files() -> Vec<PathBuf> {
    let env = |k: &str| std::env::var_os(k).map(PathBuf::from);
    let home = env("HOME");
    let mut out = Vec::new();
    out.extend(env("REGISTRY_AUTH_FILE"));
    out.extend(env("XDG_RUNTIME_DIR").map(|d| d.join("containers/auth.json")));
    out.extend(
        home.as_ref()
            .map(|h| h.join(".config/containers/auth.json")),
    );
    out.extend(env("DOCKER_CONFIG").map(|d| d.join("config.json")));
    out.extend(home.map(|h| h.join(".docker/config.json")));
    out
}

/// (user, password) for `registry` from the first auth file that has it.
fn credentials(registry: &str) -> Option<(String, String)> {
    auth_files().iter().find_map(|f| {
        std::fs::read(f)
            .ok()
            .and_then(|b| credentials_in(&b, registry))
    })
}

fn credentials_in(file: &[u8], registry: &str) -> Option<(String, String)> {
    let v: serde_json::Value = serde_json::from_slice(file).ok()?;
    let auths = v.get("auths")?.as_object()?;
    let mut names = vec![
        registry.to_string(),
        format!("https://{registry}"),
        format!("http://{registry}"),
    ];
    if registry == DOCKER_HUB {
        names.extend([
            "docker.io".into(),
            "index.docker.io".into(),
            "https://index.docker.io/v1/".into(),
        ]);
    }
    let entry = names.iter().find_map(|n| auths.get(n))?;
    if let Some(a) = entry.get("auth").and_then(|a| a.as_str()) {
        let raw = base64::engine::general_purpose::STANDARD
            .decode(a.trim())
            .ok()?;
        let text = String::from_utf8(raw).ok()?;
        let (u, p) = text.split_once(':')?;
        return Some((u.to_string(), p.to_string()));
    }
    let u = entry.get("username")?.as_str()?;
    let p = entry.get("password")?.as_str()?;
    Some((u.to_string(), p.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn challenges_and_auth_files_are_read() {
        let p = challenge_params(
            r#"realm="https://auth.example/token",service="registry.example",scope="repository:a/b:pull""#,
        );
        assert_eq!(p[0], ("realm".into(), "https://auth.example/token".into()));
        assert_eq!(p[2].1, "repository:a/b:pull");
        let file = br#"{"auths":{"reg.example:5000":{"auth":"dTpwOnc="},"https://index.docker.io/v1/":{"username":"x","password":"y"}}}"#;
        assert_eq!(
            credentials_in(file, "reg.example:5000"),
            Some(("u".into(), "p:w".into()))
        );
        assert_eq!(
            credentials_in(file, DOCKER_HUB),
            Some(("x".into(), "y".into()))
        );
        assert_eq!(credentials_in(file, "other"), None);
        assert!(insecure("127.0.0.1:5000") && insecure("localhost") && !insecure("ghcr.io"));
    }
}
