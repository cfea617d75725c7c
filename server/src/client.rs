//! A small blocking client of the native HTTP API (`ember serve`), used by the `ember` CLI
//! and usable by anything else: JSON calls, NDJSON streams read line by line, streamed
//! uploads and downloads.
//!
//! Where the server is: `EMBER_URL` (default `http://127.0.0.1:7070`); its token:
//! `EMBER_TOKEN`, else the file `$EMBER_HOME/token` when it is readable.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use crate::types::{ErrorBody, WrittenOut};
use ember_runtime::{
    ArtifactInfo, AuditRecord, CreateRequest, ForkRequest, OnTimeout, SandboxInfo, SnapshotInfo,
    SnapshotRequest, Transition,
};

/// Where `ember serve` listens by default.
pub const DEFAULT_URL: &str = "http://127.0.0.1:7070";

/// What went wrong talking to the server.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No connection could be made.
    #[error("cannot reach the ember server at {url} (is `ember serve` running?): {detail}")]
    Unreachable {
        /// The server's URL.
        url: String,
        /// The transport's error.
        detail: String,
    },
    /// The server answered with an error.
    #[error("{message} ({code}, HTTP {status})")]
    Api {
        /// HTTP status.
        status: u16,
        /// The error's code.
        code: String,
        /// The error's message.
        message: String,
    },
    /// The connection failed during the exchange.
    #[error("talking to the ember server at {url}: {detail}")]
    Transport {
        /// The server's URL.
        url: String,
        /// What failed.
        detail: String,
    },
    /// The answer was not what this client expects.
    #[error("unexpected answer from the server: {0}")]
    Decode(String),
    /// A local file or stream failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// Percent-encodes one path segment.
pub fn segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A client of one server.
#[derive(Debug, Clone)]
pub struct Client {
    base: String,
    token: Option<String>,
    agent: ureq::Agent,
}

impl Client {
    /// A client of the server at `url` authenticating with `token`.
    pub fn new(url: &str, token: Option<String>) -> Self {
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(Duration::from_secs(10))
            .user_agent(concat!("ember/", env!("CARGO_PKG_VERSION")))
            .build();
        Client {
            base: url.trim_end_matches('/').to_string(),
            token: token.filter(|t| !t.is_empty()),
            agent,
        }
    }

    /// `url` (or `EMBER_URL`, or the default) and `token` (or `EMBER_TOKEN`, or the
    /// server's token file when readable).
    pub fn from_env(url: Option<&str>, token: Option<String>) -> Self {
        let url = url
            .map(str::to_string)
            .or_else(|| std::env::var("EMBER_URL").ok().filter(|u| !u.is_empty()))
            .unwrap_or_else(|| DEFAULT_URL.to_string());
        let token = token
            .or_else(|| std::env::var("EMBER_TOKEN").ok())
            .filter(|t| !t.is_empty())
            .or_else(|| {
                std::fs::read_to_string(ember_runtime::paths::home_dir().join("token"))
                    .ok()
                    .map(|t| t.trim().to_string())
            });
        Client::new(&url, token)
    }

    /// The server's URL.
    pub fn url(&self) -> &str {
        &self.base
    }

    /// The token sent, if any (for another client of the same server: `ember mcp`'s).
    pub fn token(&self) -> Option<&str> {
        self.token.as_deref()
    }

    /// Whether a token will be sent.
    pub fn has_token(&self) -> bool {
        self.token.is_some()
    }

    fn request(&self, method: &str, path: &str, query: &[(&str, String)]) -> ureq::Request {
        let mut r = self.agent.request(method, &format!("{}{path}", self.base));
        if let Some(t) = &self.token {
            r = r.set("Authorization", &format!("Bearer {t}"));
        }
        for (k, v) in query {
            r = r.query(k, v);
        }
        r
    }

    fn fail(&self, e: ureq::Error) -> ClientError {
        match e {
            ureq::Error::Status(status, resp) => {
                let text = resp.into_string().unwrap_or_default();
                match serde_json::from_str::<ErrorBody>(&text) {
                    Ok(b) => ClientError::Api {
                        status,
                        code: b.error.code,
                        message: b.error.message,
                    },
                    Err(_) => ClientError::Api {
                        status,
                        code: format!("http_{status}"),
                        message: text.trim().chars().take(500).collect(),
                    },
                }
            }
            ureq::Error::Transport(t) => {
                let detail = t.to_string();
                match t.kind() {
                    ureq::ErrorKind::ConnectionFailed
                    | ureq::ErrorKind::Dns
                    | ureq::ErrorKind::InvalidUrl
                    | ureq::ErrorKind::UnknownScheme => ClientError::Unreachable {
                        url: self.base.clone(),
                        detail,
                    },
                    _ => ClientError::Transport {
                        url: self.base.clone(),
                        detail,
                    },
                }
            }
        }
    }

    fn decode<T: DeserializeOwned>(resp: ureq::Response) -> Result<T, ClientError> {
        resp.into_json()
            .map_err(|e| ClientError::Decode(e.to_string()))
    }

    /// `GET path?query` → JSON.
    pub fn get<T: DeserializeOwned>(
        &self,
        path: &str,
        query: &[(&str, String)],
    ) -> Result<T, ClientError> {
        let resp = self
            .request("GET", path, query)
            .call()
            .map_err(|e| self.fail(e))?;
        Self::decode(resp)
    }

    /// `METHOD path` with a JSON body → JSON.
    pub fn send<T: DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        body: &impl Serialize,
    ) -> Result<T, ClientError> {
        let body = serde_json::to_value(body).map_err(|e| ClientError::Decode(e.to_string()))?;
        let resp = self
            .request(method, path, &[])
            .send_json(body)
            .map_err(|e| self.fail(e))?;
        Self::decode(resp)
    }

    /// `DELETE path?query` → JSON.
    pub fn delete<T: DeserializeOwned>(
        &self,
        path: &str,
        query: &[(&str, String)],
    ) -> Result<T, ClientError> {
        let resp = self
            .request("DELETE", path, query)
            .call()
            .map_err(|e| self.fail(e))?;
        Self::decode(resp)
    }

    /// `POST path` with a JSON body, answered by an NDJSON stream: every line goes to
    /// `on_line` (false: stop reading and hang up, which cancels the call on the server).
    /// Returns the last line (`end`, `done` or `error`), or None when the stream was cut.
    pub fn stream(
        &self,
        path: &str,
        body: &impl Serialize,
        on_line: &mut dyn FnMut(&Value) -> bool,
    ) -> Result<Option<Value>, ClientError> {
        let body = serde_json::to_value(body).map_err(|e| ClientError::Decode(e.to_string()))?;
        let resp = self
            .request("POST", path, &[])
            .send_json(body)
            .map_err(|e| self.fail(e))?;
        let mut reader = BufReader::new(resp.into_reader());
        let mut line = String::new();
        loop {
            line.clear();
            let n = reader
                .read_line(&mut line)
                .map_err(|e| ClientError::Transport {
                    url: self.base.clone(),
                    detail: format!("the stream broke off: {e}"),
                })?;
            if n == 0 {
                return Ok(None);
            }
            if line.trim().is_empty() {
                continue;
            }
            let v: Value = serde_json::from_str(&line)
                .map_err(|e| ClientError::Decode(format!("{e}: {}", line.trim())))?;
            let terminal = matches!(v["type"].as_str(), Some("end" | "error" | "done"));
            if !on_line(&v) {
                return Ok(None);
            }
            if terminal {
                return Ok(Some(v));
            }
        }
    }

    /// Streams `data` into the guest file `path` of sandbox `id`.
    pub fn upload(
        &self,
        id: &str,
        path: &str,
        data: impl Read,
        len: Option<u64>,
    ) -> Result<WrittenOut, ClientError> {
        let mut r = self
            .request(
                "PUT",
                &format!("/v1/sandboxes/{}/files", segment(id)),
                &[("path", path.to_string())],
            )
            .set("Content-Type", "application/octet-stream");
        if let Some(n) = len {
            r = r.set("Content-Length", &n.to_string());
        }
        let resp = r.send(data).map_err(|e| self.fail(e))?;
        Self::decode(resp)
    }

    fn download_from(
        &self,
        path: &str,
        query: &[(&str, String)],
        out: &mut dyn Write,
    ) -> Result<u64, ClientError> {
        let resp = self
            .request("GET", path, query)
            .call()
            .map_err(|e| self.fail(e))?;
        let expected = resp
            .header("Content-Length")
            .and_then(|v| v.parse::<u64>().ok());
        let n =
            std::io::copy(&mut resp.into_reader(), out).map_err(|e| ClientError::Transport {
                url: self.base.clone(),
                detail: format!("the download broke off: {e}"),
            })?;
        if expected.is_some_and(|e| e != n) {
            return Err(ClientError::Transport {
                url: self.base.clone(),
                detail: format!("the download broke off after {n} bytes"),
            });
        }
        Ok(n)
    }

    /// Streams the guest file `path` of sandbox `id` into `out`.
    pub fn download(&self, id: &str, path: &str, out: &mut dyn Write) -> Result<u64, ClientError> {
        self.download_from(
            &format!("/v1/sandboxes/{}/files", segment(id)),
            &[("path", path.to_string())],
            out,
        )
    }

    /// Streams `data` into file `path` of volume `name`.
    pub fn volume_upload(
        &self,
        name: &str,
        path: &str,
        data: impl Read,
    ) -> Result<WrittenOut, ClientError> {
        let resp = self
            .request(
                "PUT",
                &format!("/v1/volumes/{}/files", segment(name)),
                &[("path", path.to_string())],
            )
            .set("Content-Type", "application/octet-stream")
            .send(data)
            .map_err(|e| self.fail(e))?;
        Self::decode(resp)
    }

    /// Streams file `path` of volume `name` into `out`.
    pub fn volume_download(
        &self,
        name: &str,
        path: &str,
        out: &mut dyn Write,
    ) -> Result<u64, ClientError> {
        self.download_from(
            &format!("/v1/volumes/{}/files", segment(name)),
            &[("path", path.to_string())],
            out,
        )
    }

    /// A PNG screenshot of a page of the sandbox's browser (`GET …/screenshot`; `target`:
    /// a page target id, default the first page) into `out`.
    pub fn screenshot(
        &self,
        id: &str,
        target: Option<&str>,
        full_page: bool,
        out: &mut dyn Write,
    ) -> Result<u64, ClientError> {
        let mut q = Vec::new();
        if let Some(t) = target {
            q.push(("target", t.to_string()));
        }
        if full_page {
            q.push(("full_page", "true".to_string()));
        }
        self.download_from(
            &format!("/v1/sandboxes/{}/screenshot", segment(id)),
            &q,
            out,
        )
    }

    /// Streams one artifact (`path` as listed) into `out`.
    pub fn download_artifact(
        &self,
        id: &str,
        path: &str,
        out: &mut dyn Write,
    ) -> Result<u64, ClientError> {
        let rel: Vec<String> = path.split('/').map(segment).collect();
        self.download_from(
            &format!("/v1/sandboxes/{}/artifacts/{}", segment(id), rel.join("/")),
            &[],
            out,
        )
    }

    /// Creates a sandbox.
    pub fn create(&self, req: &CreateRequest) -> Result<SandboxInfo, ClientError> {
        self.send("POST", "/v1/sandboxes", req)
    }

    /// Lists sandboxes.
    pub fn list(
        &self,
        all: bool,
        state: Option<&str>,
        metadata: &BTreeMap<String, String>,
    ) -> Result<Vec<SandboxInfo>, ClientError> {
        let mut q = Vec::new();
        if all {
            q.push(("all", "true".to_string()));
        }
        if let Some(s) = state {
            q.push(("state", s.to_string()));
        }
        let meta: Vec<(String, String)> = metadata
            .iter()
            .map(|(k, v)| (format!("metadata.{k}"), v.clone()))
            .collect();
        for (k, v) in &meta {
            q.push((k.as_str(), v.clone()));
        }
        self.get("/v1/sandboxes", &q)
    }

    /// One sandbox.
    pub fn sandbox(&self, id: &str) -> Result<SandboxInfo, ClientError> {
        self.get(&format!("/v1/sandboxes/{}", segment(id)), &[])
    }

    /// Kills a sandbox.
    pub fn kill(&self, id: &str) -> Result<SandboxInfo, ClientError> {
        self.delete(&format!("/v1/sandboxes/{}", segment(id)), &[])
    }

    /// `POST /v1/sandboxes/{id}/{action}` with an empty body.
    pub fn action<T: DeserializeOwned>(&self, id: &str, action: &str) -> Result<T, ClientError> {
        self.action_with(id, action, &serde_json::json!({}))
    }

    /// `POST /v1/sandboxes/{id}/{action}` with a body.
    pub fn action_with<T: DeserializeOwned>(
        &self,
        id: &str,
        action: &str,
        body: &serde_json::Value,
    ) -> Result<T, ClientError> {
        self.send(
            "POST",
            &format!("/v1/sandboxes/{}/{action}", segment(id)),
            body,
        )
    }

    /// Sets a sandbox's timeout.
    pub fn set_timeout(
        &self,
        id: &str,
        secs: u64,
        on_timeout: Option<OnTimeout>,
    ) -> Result<SandboxInfo, ClientError> {
        self.send(
            "POST",
            &format!("/v1/sandboxes/{}/timeout", segment(id)),
            &serde_json::json!({"timeout_secs": secs, "on_timeout": on_timeout}),
        )
    }

    /// Takes a named snapshot.
    pub fn snapshot(&self, id: &str, req: &SnapshotRequest) -> Result<SnapshotInfo, ClientError> {
        self.send(
            "POST",
            &format!("/v1/sandboxes/{}/snapshot", segment(id)),
            req,
        )
    }

    /// Forks a sandbox.
    pub fn fork(&self, id: &str, req: &ForkRequest) -> Result<Vec<SandboxInfo>, ClientError> {
        self.send("POST", &format!("/v1/sandboxes/{}/fork", segment(id)), req)
    }

    /// A sandbox's state history.
    pub fn history(&self, id: &str) -> Result<Vec<Transition>, ClientError> {
        self.get(&format!("/v1/sandboxes/{}/history", segment(id)), &[])
    }

    /// A sandbox's audit records.
    pub fn audit(
        &self,
        id: &str,
        query: &[(&str, String)],
    ) -> Result<Vec<AuditRecord>, ClientError> {
        self.get(&format!("/v1/sandboxes/{}/audit", segment(id)), query)
    }

    /// A sandbox's artifacts.
    pub fn artifacts(&self, id: &str) -> Result<Vec<ArtifactInfo>, ClientError> {
        self.get(&format!("/v1/sandboxes/{}/artifacts", segment(id)), &[])
    }

    /// Collects a sandbox's artifacts now.
    pub fn collect_artifacts(&self, id: &str) -> Result<Vec<ArtifactInfo>, ClientError> {
        self.action(id, "artifacts/collect")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_are_percent_encoded() {
        assert_eq!(segment("abc-1_2.x~"), "abc-1_2.x~");
        assert_eq!(segment("a b/c?d"), "a%20b%2Fc%3Fd");
        assert_eq!(segment("é"), "%C3%A9");
    }

    /// Serves the API over the fake backend on a free port until the guard drops.
    fn serve_fake() -> (
        Client,
        std::sync::Arc<crate::tests::Fake>,
        tokio::sync::oneshot::Sender<()>,
    ) {
        use crate::tests::{Fake, TOKEN};
        let dir = tempfile::tempdir().unwrap();
        let token_file = dir.path().join("token");
        std::fs::write(&token_file, TOKEN).unwrap();
        let fake = std::sync::Arc::new(Fake::default());
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let f2 = fake.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let server = crate::Server::bind(crate::ServeOptions {
                    listen: "127.0.0.1:0".parse().unwrap(),
                    token_file,
                    shutdown_grace: Duration::from_secs(1),
                    ..Default::default()
                })
                .await
                .unwrap();
                addr_tx.send(server.local_addr()).unwrap();
                let _ = server
                    .run_until(f2, async {
                        let _ = stop_rx.await;
                    })
                    .await;
                drop(dir);
            });
        });
        let addr = addr_rx.recv().unwrap();
        let c = Client::new(&format!("http://{addr}"), Some(TOKEN.into()));
        (c, fake, stop_tx)
    }

    #[test]
    fn the_client_speaks_to_the_server() {
        use crate::tests::KNOWN;
        let (c, fake, _stop) = serve_fake();
        assert_eq!(c.sandbox(KNOWN).unwrap().id, KNOWN);
        match c.sandbox("nope") {
            Err(ClientError::Api { status, code, .. }) => {
                assert_eq!((status, code.as_str()), (404, "sandbox_not_found"))
            }
            other => panic!("{other:?}"),
        }
        // Streams: every line, the last one returned.
        let mut seen = Vec::new();
        let last = c
            .stream(
                &format!("/v1/sandboxes/{KNOWN}/code"),
                &serde_json::json!({"code": "1"}),
                &mut |v| {
                    seen.push(v["type"].as_str().unwrap_or("").to_string());
                    true
                },
            )
            .unwrap()
            .unwrap();
        assert_eq!(seen, ["stdout", "end"]);
        assert_eq!(last["status"], "ok");
        // Stopping early hangs up, which cancels the call on the server.
        let mut n = 0;
        let last = c
            .stream(
                &format!("/v1/sandboxes/{KNOWN}/code"),
                &serde_json::json!({"code": "forever"}),
                &mut |_| {
                    n += 1;
                    n < 3
                },
            )
            .unwrap();
        assert!(last.is_none());
        let t0 = std::time::Instant::now();
        while !fake.cancelled.load(std::sync::atomic::Ordering::SeqCst) {
            assert!(t0.elapsed() < Duration::from_secs(10), "not cancelled");
            std::thread::sleep(Duration::from_millis(10));
        }
        // Uploads stream (with and without a length); downloads too.
        let w = c.upload(KNOWN, "/f", &b"abc"[..], Some(3)).unwrap();
        assert_eq!((w.path.as_str(), w.bytes), ("/f", 3));
        let w = c.upload(KNOWN, "/f", &[5u8; 900][..], None).unwrap();
        assert_eq!(w.bytes, 900);
        assert_eq!(fake.written.lock().unwrap().len(), 900);
        match c.upload(KNOWN, "/f", &[5u8; 5000][..], None) {
            Err(ClientError::Api { status: 413, .. }) => {}
            // The server may answer before reading everything and close the connection.
            Err(ClientError::Transport { .. }) => {}
            other => panic!("{other:?}"),
        }
        let mut out = Vec::new();
        assert_eq!(c.download(KNOWN, "/data", &mut out).unwrap(), 300_000);
        assert_eq!(out.len(), 300_000);
        match c.download(KNOWN, "/missing", &mut Vec::new()) {
            Err(ClientError::Api {
                status: 422, code, ..
            }) => assert_eq!(code, "guest_not_found"),
            other => panic!("{other:?}"),
        }
        // A wrong token.
        let bad = Client::new(c.url(), Some("wrong".into()));
        match bad.sandbox(KNOWN) {
            Err(ClientError::Api { status: 401, .. }) => {}
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_server_that_is_not_there_is_unreachable() {
        // Port 9 (discard) on loopback: nothing listens in a test environment.
        let c = Client::new("http://127.0.0.1:9", None);
        match c.sandbox("x") {
            Err(ClientError::Unreachable { url, .. }) => assert_eq!(url, "http://127.0.0.1:9"),
            other => panic!("{other:?}"),
        }
    }
}
