//! `/mcp`: the sandboxes as MCP tools (Model Context Protocol, streamable HTTP), for agents.
//!
//! One implementation of the tools, over the call surface: every tool is one or two
//! [`call`](ember_runtime::call) requests sent to the server's [`Backend`] (a `Handler`), so
//! `ember serve` (the local runtime) and `ember gateway` (the fleet) serve the same tools, and
//! `ember mcp` (the CLI's stdio server) forwards to this endpoint instead of implementing them
//! again. The tools hold no state: a sandbox is named by its id in every call.
//!
//! Tools: `create_sandbox`, `run_code`, `run_command`, `read_file`, `write_file`,
//! `list_files`, `download_artifact`, `browser_screenshot`, `pause_sandbox`,
//! `resume_sandbox`, `kill_sandbox`, `list_sandboxes`. What they answer:
//!
//! - A runtime error (no such sandbox, a guest error, a refused policy) is a tool error
//!   (`isError: true`) carrying the runtime's message; a tool never panics on its input.
//! - Code output: stdout as text, stderr as text headed `[stderr]`, each result or display
//!   as its richest form an agent can take — `image/png`/`image/jpeg` as image content,
//!   else `text/plain`, `text/html`, `text/markdown` or `application/json` as text —, an
//!   exception as text (and `isError`).
//! - Files and artifacts: UTF-8 as text, images as image content, anything else as an
//!   embedded resource (base64 blob). Transfers are bounded ([`MAX_FILE_BYTES`]): a bigger
//!   file is refused by name and size, before any byte moves.
//! - `create_sandbox` answers the sandbox as JSON, also as structured content
//!   (`{"sandbox_id": …}`), which is how `ember mcp` learns what to kill when it exits.
//!
//! Transport: rmcp's streamable HTTP service, stateless (no session: any gateway replica
//! answers any request) with JSON responses, nested in the router behind the same bearer
//! token as the rest of the API (`lib.rs`'s `auth` layer). The SDK's `Host` check against
//! DNS rebinding is off: a browser page cannot send the bearer token, which every request
//! needs.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{
    CallToolResult, ContentBlock, Implementation, ResourceContents, ServerCapabilities,
    ServerConfig,
};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{tool, tool_handler, tool_router, ServerHandler};
use schemars::JsonSchema;
use serde::Deserialize;

use ember_runtime::call::{
    self, Cancel, CancelOnDrop, EndStatus, EventKind, Exception, ExecRequest, ExitStatus, FileType,
    Io, RunCodeRequest,
};
use ember_runtime::netpolicy::Cidr4;
use ember_runtime::{
    CreateRequest, ListFilter, NetMode, NetworkPolicy, RunEnd, RuntimeError, SandboxInfo,
};

use crate::{browser, AppState, Backend};

/// Largest file or artifact a tool reads or writes, in bytes (base64 in a JSON-RPC message
/// adds a third).
pub const MAX_FILE_BYTES: u64 = 8 << 20;
/// Largest code or command accepted, in bytes.
pub const MAX_CODE_BYTES: usize = 1 << 20;
/// Most stdout + stderr + display bytes a `run_code` or `run_command` returns.
pub const OUTPUT_CAP: u64 = 4 << 20;
/// Most directory entries `list_files` returns.
pub const MAX_ENTRIES: usize = 5000;
/// Time limit of code and commands when the caller gives none, and the most it may give.
pub const DEFAULT_RUN_SECS: u64 = 300;
/// See [`DEFAULT_RUN_SECS`].
pub const MAX_RUN_SECS: u64 = 3600;
/// Largest JSON-RPC request body accepted on `/mcp` (a `write_file` of [`MAX_FILE_BYTES`] in
/// base64, with room to spare).
const MAX_REQUEST_BYTES: usize = 16 << 20;

/// Why a tool failed (answered as a tool error with this message).
#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    /// The runtime refused or failed the call.
    #[error("{0}")]
    Runtime(#[from] RuntimeError),
    /// The arguments are wrong.
    #[error("{0}")]
    Invalid(String),
    /// Over a size limit.
    #[error("{what} is {size} bytes, over the limit of {limit} bytes")]
    TooLarge {
        /// What was too large (the file, by name).
        what: String,
        /// Its size.
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// The blocking call could not be run or was lost.
    #[error("the call failed: {0}")]
    Join(String),
    /// The browser screenshot failed.
    #[error("{0}")]
    Screenshot(String),
}

impl From<ToolError> for CallToolResult {
    fn from(e: ToolError) -> Self {
        CallToolResult::error(vec![ContentBlock::text(e.to_string())])
    }
}

/// A tool's answer: its content, or the error as a tool error.
fn answer(r: Result<CallToolResult, ToolError>) -> CallToolResult {
    r.unwrap_or_else(CallToolResult::from)
}

// --- arguments ------------------------------------------------------------------------------

/// The network of a new sandbox.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NetworkArgs {
    /// Reach the internet (NAT out; link-local, the host and private ranges stay
    /// unreachable). Default false: no network at all.
    #[serde(default)]
    pub internet: bool,
    /// Destinations to allow: IPv4 addresses/CIDRs (allowed even inside the private ranges)
    /// and domain names (`example.com`, `*.example.com`). Without `internet`, only these are
    /// reachable; with it, only CIDRs may be named here (domains would restrict the
    /// internet to themselves: leave `internet` false for that).
    #[serde(default)]
    pub allow_out: Vec<String>,
    /// IPv4 addresses/CIDRs never reachable (on top of the always-on deny list).
    #[serde(default)]
    pub deny_out: Vec<String>,
}

/// `create_sandbox`.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CreateSandboxArgs {
    /// Template to start from: `default` (Python with IPython, bash), `python-data` (numpy,
    /// pandas, scipy, matplotlib), `code-interpreter` (python-data plus JavaScript,
    /// TypeScript, R and Java), `browser` (headless Chromium) or any other built on the
    /// server. Default `default`.
    #[serde(default)]
    pub template: Option<String>,
    /// Seconds of life from now (then the sandbox is killed); default the server's (300).
    #[serde(default)]
    pub timeout_secs: Option<u64>,
    /// Network access; default none.
    #[serde(default)]
    pub network: Option<NetworkArgs>,
    /// Environment variables for code and commands run in the sandbox.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
}

/// A sandbox by id.
#[derive(Debug, Clone, Deserialize, JsonSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SandboxArgs {
    /// The sandbox's id (from `create_sandbox` or `list_sandboxes`).
    pub sandbox_id: String,
}

/// `run_code`.
#[derive(Debug, Clone, Deserialize, JsonSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RunCodeArgs {
    /// The sandbox's id.
    pub sandbox_id: String,
    /// The code. State (variables, imports) persists between calls in the same context.
    pub code: String,
    /// `python` (default), `bash`, `javascript`, `typescript`, `r` or `java` (those the
    /// sandbox's template has), when no context is named.
    #[serde(default)]
    pub language: Option<String>,
    /// The code context (an interpreter with its own state); default the language's
    /// default context.
    #[serde(default)]
    pub context: Option<String>,
    /// Time limit in seconds (default 300, at most 3600): then the code is interrupted.
    #[serde(default)]
    pub timeout_secs: Option<u64>,
}

/// `run_command`.
#[derive(Debug, Clone, Deserialize, JsonSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RunCommandArgs {
    /// The sandbox's id.
    pub sandbox_id: String,
    /// A shell command line, run by `/bin/bash -c`.
    pub command: String,
    /// Working directory (default `/`).
    #[serde(default)]
    pub cwd: Option<String>,
    /// Extra environment variables.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Time limit in seconds (default 300, at most 3600): then the command's process group
    /// is killed.
    #[serde(default)]
    pub timeout_secs: Option<u64>,
}

/// A path in a sandbox.
#[derive(Debug, Clone, Deserialize, JsonSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PathArgs {
    /// The sandbox's id.
    pub sandbox_id: String,
    /// Absolute path in the sandbox.
    pub path: String,
}

/// How `write_file`'s content is encoded.
#[derive(Debug, Clone, Copy, Default, Deserialize, JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Encoding {
    /// The content is the file's text (UTF-8).
    #[default]
    Text,
    /// The content is the file's bytes in standard base64.
    Base64,
}

/// `write_file`.
#[derive(Debug, Clone, Deserialize, JsonSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct WriteFileArgs {
    /// The sandbox's id.
    pub sandbox_id: String,
    /// Absolute path in the sandbox (missing directories are made).
    pub path: String,
    /// The file's content.
    pub content: String,
    /// `text` (default) or `base64`.
    #[serde(default)]
    pub encoding: Encoding,
}

/// `list_files`.
#[derive(Debug, Clone, Deserialize, JsonSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ListFilesArgs {
    /// The sandbox's id.
    pub sandbox_id: String,
    /// Directory (default `/workspace`).
    #[serde(default)]
    pub path: Option<String>,
    /// How deep to list (default 1: the directory's own entries; at most 10).
    #[serde(default)]
    pub depth: Option<u32>,
}

/// `download_artifact`.
#[derive(Debug, Clone, Deserialize, JsonSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ArtifactArgs {
    /// The sandbox's id.
    pub sandbox_id: String,
    /// The artifact's path relative to the outputs directory (`/workspace/outputs`).
    /// Without it: collect the outputs now and list them.
    #[serde(default)]
    pub path: Option<String>,
}

/// `browser_screenshot`.
#[derive(Debug, Clone, Deserialize, JsonSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ScreenshotArgs {
    /// The id of a sandbox of the `browser` template.
    pub sandbox_id: String,
    /// The whole page rather than the viewport.
    #[serde(default)]
    pub full_page: bool,
}

/// `list_sandboxes`.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ListArgs {
    /// Include stopped and failed sandboxes (default: only live ones).
    #[serde(default)]
    pub all: bool,
}

// --- argument checks ------------------------------------------------------------------------

/// The network policy `n` asks for.
pub fn network_policy(n: &NetworkArgs) -> Result<NetworkPolicy, ToolError> {
    let (mut cidrs, mut domains) = (Vec::new(), Vec::new());
    for a in &n.allow_out {
        let a = a.trim();
        if Cidr4::parse(a).is_ok() {
            cidrs.push(a.to_string());
        } else if a.contains(':') || a.parse::<std::net::Ipv4Addr>().is_ok() || a.contains('/') {
            let why = Cidr4::parse(a).err().unwrap_or_default();
            return Err(ToolError::Invalid(format!("network.allow_out: {why}")));
        } else {
            domains.push(a.to_string());
        }
    }
    let mut p = NetworkPolicy {
        deny_cidrs: n.deny_out.iter().map(|s| s.trim().to_string()).collect(),
        ..Default::default()
    };
    if n.internet {
        if !domains.is_empty() {
            return Err(ToolError::Invalid(format!(
                "network.allow_out names domains ({}) with internet true, which reaches every \
                 domain already: set internet false to allow only the listed ones",
                domains.join(", ")
            )));
        }
        p.mode = NetMode::Egress;
        p.allow_cidrs = cidrs;
    } else if cidrs.is_empty() && domains.is_empty() {
        p.mode = NetMode::None;
    } else {
        p.mode = NetMode::Egress;
        p.allow_cidrs = cidrs;
        if domains.is_empty() {
            // Only the listed addresses: everything else is denied (the allow list is
            // checked before the deny lists).
            p.deny_cidrs.push("0.0.0.0/0".into());
        }
        p.allow_domains = domains;
    }
    p.validate()
        .map_err(|e| ToolError::Invalid(format!("network: {e}")))?;
    Ok(p)
}

/// The create request `a` asks for.
pub fn create_request(a: &CreateSandboxArgs) -> Result<CreateRequest, ToolError> {
    Ok(CreateRequest {
        template: a.template.clone().filter(|t| !t.trim().is_empty()),
        timeout_secs: a.timeout_secs,
        env: a.env.clone(),
        network: match &a.network {
            Some(n) => network_policy(n)?,
            None => NetworkPolicy::default(),
        },
        ..Default::default()
    })
}

/// A time limit in seconds (default and cap as [`DEFAULT_RUN_SECS`] says).
pub fn run_limit(secs: Option<u64>) -> Result<Duration, ToolError> {
    match secs {
        None => Ok(Duration::from_secs(DEFAULT_RUN_SECS)),
        Some(0) => Err(ToolError::Invalid("timeout_secs must be at least 1".into())),
        Some(s) if s > MAX_RUN_SECS => Err(ToolError::Invalid(format!(
            "timeout_secs is {s}, over the limit of {MAX_RUN_SECS}"
        ))),
        Some(s) => Ok(Duration::from_secs(s)),
    }
}

fn check_code(what: &str, code: &str) -> Result<(), ToolError> {
    if code.len() > MAX_CODE_BYTES {
        return Err(ToolError::TooLarge {
            what: what.into(),
            size: code.len() as u64,
            limit: MAX_CODE_BYTES as u64,
        });
    }
    Ok(())
}

fn check_path(path: &str) -> Result<(), ToolError> {
    if !path.starts_with('/') {
        return Err(ToolError::Invalid(format!(
            "path {path:?} is not absolute (start it with /)"
        )));
    }
    Ok(())
}

/// The bytes `write_file` writes.
pub fn write_bytes(a: &WriteFileArgs) -> Result<Vec<u8>, ToolError> {
    let bytes = match a.encoding {
        Encoding::Text => a.content.as_bytes().to_vec(),
        Encoding::Base64 => base64::engine::general_purpose::STANDARD
            .decode(a.content.trim())
            .map_err(|e| ToolError::Invalid(format!("content is not base64: {e}")))?,
    };
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(ToolError::TooLarge {
            what: format!("the content for {}", a.path),
            size: bytes.len() as u64,
            limit: MAX_FILE_BYTES,
        });
    }
    Ok(bytes)
}

// --- results → content ----------------------------------------------------------------------

/// What a `run_code` produced, gathered from its events.
#[derive(Debug, Default)]
pub struct CodeOutput {
    /// stdout bytes.
    pub stdout: Vec<u8>,
    /// stderr bytes.
    pub stderr: Vec<u8>,
    /// Results and displays, in order (MIME type → value).
    pub items: Vec<serde_json::Map<String, serde_json::Value>>,
    /// The exception, if the code raised.
    pub error: Option<Exception>,
    /// The output cap, if it was reached.
    pub truncated: Option<u64>,
    /// The program's exit status (`run_command`).
    pub exit: Option<ExitStatus>,
    /// Bytes dropped past [`OUTPUT_CAP`] (`run_command`).
    pub dropped: u64,
}

impl CodeOutput {
    /// Takes one event; false never (the sink goes on to the end).
    pub fn take(&mut self, ev: &EventKind) {
        let kept = (self.stdout.len() + self.stderr.len()) as u64;
        let room = OUTPUT_CAP.saturating_sub(kept) as usize;
        match ev {
            EventKind::Stdout { data } | EventKind::Stderr { data } => {
                let n = data.len().min(room);
                self.dropped += (data.len() - n) as u64;
                let to = match ev {
                    EventKind::Stdout { .. } => &mut self.stdout,
                    _ => &mut self.stderr,
                };
                to.extend_from_slice(&data[..n]);
            }
            EventKind::Result(r) => self.items.push(r.data.clone()),
            EventKind::Display(d) => self.items.push(d.data.clone()),
            EventKind::Exception(e) => self.error = Some(e.clone()),
            EventKind::Truncated { limit } => self.truncated = Some(*limit),
            EventKind::Exit(st) => self.exit = Some(*st),
            _ => {}
        }
    }
}

/// Removes ANSI escape sequences (IPython colours its tracebacks).
pub fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.peek() == Some(&'[') {
                chars.next();
                for c in chars.by_ref() {
                    if ('@'..='~').contains(&c) {
                        break;
                    }
                }
            }
            continue;
        }
        out.push(c);
    }
    out
}

/// One result or display bundle as content: an image if it has one, else its best text.
pub fn bundle_content(b: &serde_json::Map<String, serde_json::Value>) -> Option<ContentBlock> {
    for mime in ["image/png", "image/jpeg"] {
        if let Some(data) = b.get(mime).and_then(|v| v.as_str()) {
            let data: String = data.chars().filter(|c| !c.is_whitespace()).collect();
            return Some(ContentBlock::image(data, mime));
        }
    }
    for mime in ["text/plain", "text/markdown", "text/html", "image/svg+xml"] {
        if let Some(text) = b.get(mime).and_then(|v| v.as_str()) {
            return Some(ContentBlock::text(text.to_string()));
        }
    }
    b.get("application/json")
        .map(|v| ContentBlock::text(v.to_string()))
}

/// A `run_code`'s answer.
pub fn code_result(out: &CodeOutput, end: &RunEnd, limit: Duration) -> CallToolResult {
    let mut content = Vec::new();
    if !out.stdout.is_empty() {
        content.push(ContentBlock::text(
            String::from_utf8_lossy(&out.stdout).into_owned(),
        ));
    }
    if !out.stderr.is_empty() {
        content.push(ContentBlock::text(format!(
            "[stderr]\n{}",
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    content.extend(out.items.iter().filter_map(bundle_content));
    if let Some(e) = &out.error {
        let mut text = format!("{}: {}", e.name, e.value);
        if !e.traceback.is_empty() {
            text = format!("{text}\n{}", strip_ansi(&e.traceback.join("\n")));
        }
        content.push(ContentBlock::text(format!("[error]\n{text}")));
    }
    if let Some(cap) = out.truncated {
        content.push(ContentBlock::text(format!(
            "[output truncated at {cap} bytes]"
        )));
    }
    let failed = match end.status {
        EndStatus::Ok => out.error.is_some(),
        EndStatus::Error => true,
        EndStatus::TimedOut => {
            content.push(ContentBlock::text(format!(
                "[timed out after {} s: the code was interrupted]",
                limit.as_secs()
            )));
            true
        }
        EndStatus::Interrupted => {
            content.push(ContentBlock::text("[interrupted]"));
            true
        }
        EndStatus::ContextDied => {
            content.push(ContentBlock::text(
                "[the context's interpreter died; its state is lost]",
            ));
            true
        }
        EndStatus::Unknown => true,
    };
    if content.is_empty() {
        content.push(ContentBlock::text("(no output)"));
    }
    if failed {
        CallToolResult::error(content)
    } else {
        CallToolResult::success(content)
    }
}

/// A `run_command`'s answer.
pub fn command_result(out: &CodeOutput, end: EndStatus, limit: Duration) -> CallToolResult {
    let mut content = Vec::new();
    if !out.stdout.is_empty() {
        content.push(ContentBlock::text(
            String::from_utf8_lossy(&out.stdout).into_owned(),
        ));
    }
    if !out.stderr.is_empty() {
        content.push(ContentBlock::text(format!(
            "[stderr]\n{}",
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    if out.dropped > 0 {
        content.push(ContentBlock::text(format!(
            "[output truncated: {} bytes past the first {OUTPUT_CAP} dropped]",
            out.dropped
        )));
    }
    let failed = match (end, out.exit) {
        (EndStatus::TimedOut, _) => {
            content.push(ContentBlock::text(format!(
                "[timed out after {} s: the command was killed]",
                limit.as_secs()
            )));
            true
        }
        (_, Some(st)) => {
            content.push(ContentBlock::text(format!("[{st}]")));
            !st.success()
        }
        (_, None) => {
            content.push(ContentBlock::text("[no exit status]"));
            true
        }
    };
    if failed {
        CallToolResult::error(content)
    } else {
        CallToolResult::success(content)
    }
}

/// A MIME type by file name (the few an agent meets; else `application/octet-stream`).
pub fn mime_of(path: &str) -> &'static str {
    let ext = path
        .rsplit_once('.')
        .map(|(_, e)| e.to_ascii_lowercase())
        .unwrap_or_default();
    match ext.as_str() {
        "png" => "image/png",
        "jpg" | "jpeg" => "image/jpeg",
        "gif" => "image/gif",
        "webp" => "image/webp",
        "svg" => "image/svg+xml",
        "pdf" => "application/pdf",
        "json" => "application/json",
        "csv" => "text/csv",
        "html" | "htm" => "text/html",
        "txt" | "md" | "py" | "sh" | "log" => "text/plain",
        "zip" => "application/zip",
        "gz" => "application/gzip",
        _ => "application/octet-stream",
    }
}

/// A file's bytes as content: images as image content, UTF-8 as text, the rest as an
/// embedded resource (base64 blob) named `uri`.
pub fn file_content(path: &str, uri: &str, bytes: Vec<u8>) -> ContentBlock {
    let mime = mime_of(path);
    let b64 = || base64::engine::general_purpose::STANDARD.encode(&bytes);
    if matches!(
        mime,
        "image/png" | "image/jpeg" | "image/gif" | "image/webp"
    ) {
        return ContentBlock::image(b64(), mime);
    }
    match String::from_utf8(bytes.clone()) {
        Ok(text) => ContentBlock::text(text),
        Err(_) => ContentBlock::resource(ResourceContents::blob(b64(), uri).with_mime_type(mime)),
    }
}

/// A sandbox as the tools show it.
pub fn sandbox_json(s: &SandboxInfo) -> serde_json::Value {
    serde_json::json!({
        "sandbox_id": s.id,
        "template": s.template,
        "state": s.state.as_str(),
        "reason": s.reason,
        "created_at": s.created_at,
        "ends_at": s.ends_at,
        "metadata": s.metadata,
    })
}

fn sandbox_result(s: &SandboxInfo) -> CallToolResult {
    let v = sandbox_json(s);
    let mut r = CallToolResult::success(vec![ContentBlock::text(v.to_string())]);
    r.structured_content = Some(v);
    r
}

/// A writer that refuses more than `limit` bytes.
struct Bounded {
    buf: Vec<u8>,
    limit: u64,
}

impl Write for Bounded {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if (self.buf.len() + b.len()) as u64 > self.limit {
            return Err(std::io::Error::other(format!(
                "more than {} bytes",
                self.limit
            )));
        }
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

// --- the tools ------------------------------------------------------------------------------

/// The MCP server: the tools over the server's backend.
#[derive(Clone)]
pub struct EmberMcp {
    state: AppState,
    tool_router: ToolRouter<Self>,
}

impl std::fmt::Debug for EmberMcp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmberMcp").finish_non_exhaustive()
    }
}

impl EmberMcp {
    /// The tools over `state`'s backend.
    pub fn new(state: AppState) -> Self {
        EmberMcp {
            state,
            tool_router: Self::tool_router(),
        }
    }

    /// Runs `f` on a blocking thread (backend calls block). The `Cancel` it gets fires when
    /// the tool call's future is dropped (the client went away or cancelled): event sinks
    /// check it and stop the guest work.
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&dyn Backend, &std::sync::Arc<Cancel>) -> Result<T, ToolError> + Send + 'static,
    ) -> Result<T, ToolError> {
        let cancel = Cancel::new();
        let _stop = CancelOnDrop(cancel.clone());
        let job = self.state.spawn(move |b| Ok(f(b, &cancel)));
        match job.await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => Err(e.into()),
            Err(e) => Err(ToolError::Join(e.to_string())),
        }
    }

    async fn lifecycle<C>(&self, call: C) -> CallToolResult
    where
        C: call::Call<Reply = SandboxInfo> + Send + 'static,
    {
        answer(
            self.blocking(move |b, _| Ok(b.call(call, Io::none())?))
                .await
                .map(|s| sandbox_result(&s)),
        )
    }

    /// Reads a file (or artifact) of at most [`MAX_FILE_BYTES`], refused by name beyond.
    fn read_bounded<C>(
        b: &dyn Backend,
        call: C,
        name: &str,
        size: u64,
    ) -> Result<Vec<u8>, ToolError>
    where
        C: call::Call<Reply = u64>,
    {
        if size > MAX_FILE_BYTES {
            return Err(ToolError::TooLarge {
                what: name.to_string(),
                size,
                limit: MAX_FILE_BYTES,
            });
        }
        let mut w = Bounded {
            buf: Vec::with_capacity(size as usize),
            limit: MAX_FILE_BYTES,
        };
        b.call(call, Io::output(&mut w))?;
        Ok(w.buf)
    }
}

#[tool_router]
impl EmberMcp {
    #[tool(
        description = "Create a sandbox: a Firecracker-style microVM with Python (IPython) and \
        bash, isolated from the host. Returns its sandbox_id, which every other tool takes. \
        It lives timeout_secs (default 300) then is killed; no network unless asked for."
    )]
    async fn create_sandbox(&self, Parameters(a): Parameters<CreateSandboxArgs>) -> CallToolResult {
        let req = match create_request(&a) {
            Ok(r) => r,
            Err(e) => return e.into(),
        };
        answer(
            self.blocking(move |b, _| Ok(b.call(call::Create { req }, Io::none())?))
                .await
                .map(|s| sandbox_result(&s)),
        )
    }

    #[tool(
        description = "Run code in a sandbox (Python by default, or bash) in a persistent \
        context: variables and imports stay for the next call. Returns stdout, stderr \
        ([stderr]), the value of the last expression, displayed objects (matplotlib figures \
        and other images as image content, HTML/text as text) and the error with its \
        traceback ([error], and isError)."
    )]
    async fn run_code(&self, Parameters(a): Parameters<RunCodeArgs>) -> CallToolResult {
        let limit = match run_limit(a.timeout_secs).and_then(|l| {
            check_code("the code", &a.code)?;
            Ok(l)
        }) {
            Ok(l) => l,
            Err(e) => return e.into(),
        };
        let req = RunCodeRequest {
            context: a.context.filter(|c| !c.is_empty()),
            language: a.language.filter(|l| !l.is_empty()),
            code: a.code,
            timeout_ms: Some(limit.as_millis() as u64),
            output_cap: Some(OUTPUT_CAP),
            ..Default::default()
        };
        let id = a.sandbox_id;
        answer(
            self.blocking(move |b, cancel| {
                let mut out = CodeOutput::default();
                let mut sink = |ev: &EventKind| {
                    out.take(ev);
                    !cancel.fired()
                };
                // The cancel (the MCP request went away) also stops code that prints nothing.
                let io = Io::events(&mut sink).with_cancel(cancel.clone());
                let end = b.call(call::RunCode { id, req }, io)?;
                Ok(code_result(&out, &end, limit))
            })
            .await,
        )
    }

    #[tool(
        description = "Run a shell command in a sandbox (/bin/bash -c COMMAND, as root). \
        Returns stdout, stderr ([stderr]) and the exit status; a non-zero exit is an error."
    )]
    async fn run_command(&self, Parameters(a): Parameters<RunCommandArgs>) -> CallToolResult {
        let limit = match run_limit(a.timeout_secs).and_then(|l| {
            check_code("the command", &a.command)?;
            Ok(l)
        }) {
            Ok(l) => l,
            Err(e) => return e.into(),
        };
        let req = ExecRequest {
            argv: vec!["/bin/bash".into(), "-c".into(), a.command],
            env: a.env,
            cwd: a.cwd.filter(|c| !c.is_empty()),
            timeout_ms: Some(limit.as_millis() as u64),
            ..Default::default()
        };
        let id = a.sandbox_id;
        answer(
            self.blocking(move |b, cancel| {
                let mut out = CodeOutput::default();
                let mut sink = |ev: &EventKind| {
                    out.take(ev);
                    !cancel.fired()
                };
                let end = b.call(call::Exec { id, req }, Io::events(&mut sink))?;
                Ok(command_result(&out, end, limit))
            })
            .await,
        )
    }

    #[tool(
        description = "Read a file from a sandbox (at most 8 MiB): text as text, images as \
        image content, other binary files as a base64 resource."
    )]
    async fn read_file(&self, Parameters(a): Parameters<PathArgs>) -> CallToolResult {
        if let Err(e) = check_path(&a.path) {
            return e.into();
        }
        answer(
            self.blocking(move |b, _| {
                let st = b.call(
                    call::Stat {
                        id: a.sandbox_id.clone(),
                        path: a.path.clone(),
                    },
                    Io::none(),
                )?;
                if st.kind == FileType::Dir {
                    return Err(ToolError::Invalid(format!(
                        "{} is a directory: list it with list_files",
                        a.path
                    )));
                }
                let uri = format!("sandbox://{}{}", a.sandbox_id, a.path);
                let bytes = Self::read_bounded(
                    b,
                    call::ReadFile {
                        id: a.sandbox_id,
                        path: a.path.clone(),
                    },
                    &a.path,
                    st.size,
                )?;
                Ok(CallToolResult::success(vec![file_content(
                    &a.path, &uri, bytes,
                )]))
            })
            .await,
        )
    }

    #[tool(
        description = "Write a file in a sandbox (at most 8 MiB; missing directories are \
        made): content as text, or base64 with encoding \"base64\"."
    )]
    async fn write_file(&self, Parameters(a): Parameters<WriteFileArgs>) -> CallToolResult {
        let bytes = match check_path(&a.path).and_then(|_| write_bytes(&a)) {
            Ok(b) => b,
            Err(e) => return e.into(),
        };
        answer(
            self.blocking(move |b, _| {
                let mut r = std::io::Cursor::new(bytes);
                let n = b.call(
                    call::WriteFile {
                        id: a.sandbox_id,
                        path: a.path.clone(),
                        user: Default::default(),
                    },
                    Io::input(&mut r),
                )?;
                Ok(CallToolResult::success(vec![ContentBlock::text(format!(
                    "wrote {n} bytes to {}",
                    a.path
                ))]))
            })
            .await,
        )
    }

    #[tool(
        description = "List a directory of a sandbox (default /workspace), depth levels deep \
        (default 1): one line per entry, type, size in bytes and path (directories end \
        with /)."
    )]
    async fn list_files(&self, Parameters(a): Parameters<ListFilesArgs>) -> CallToolResult {
        let path = a.path.unwrap_or_else(|| "/workspace".into());
        let depth = a.depth.unwrap_or(1);
        if let Err(e) = check_path(&path) {
            return e.into();
        }
        if !(1..=10).contains(&depth) {
            return ToolError::Invalid(format!("depth is {depth}: give 1 to 10")).into();
        }
        answer(
            self.blocking(move |b, _| {
                let entries = b.call(
                    call::ListFiles {
                        id: a.sandbox_id,
                        path: path.clone(),
                        depth,
                    },
                    Io::none(),
                )?;
                let mut lines: Vec<String> = entries
                    .iter()
                    .take(MAX_ENTRIES)
                    .map(|e| {
                        let (kind, slash) = match e.kind {
                            FileType::Dir => ("dir ", "/"),
                            FileType::File => ("file", ""),
                            FileType::Symlink => ("link", ""),
                            FileType::Other => ("othr", ""),
                        };
                        format!("{kind} {:>10} {}{slash}", e.size, e.path)
                    })
                    .collect();
                if entries.len() > MAX_ENTRIES {
                    lines.push(format!(
                        "[{} more entries not shown]",
                        entries.len() - MAX_ENTRIES
                    ));
                }
                if lines.is_empty() {
                    lines.push(format!("({path} is empty)"));
                }
                Ok(CallToolResult::success(vec![ContentBlock::text(
                    lines.join("\n"),
                )]))
            })
            .await,
        )
    }

    #[tool(description = "The sandbox's artifacts: files its code wrote under \
        /workspace/outputs, copied out of the sandbox (they outlive it). Without path: \
        collect them now and list them (path and size). With path: that artifact (at most \
        8 MiB; text as text, images as image content, binary as a base64 resource).")]
    async fn download_artifact(&self, Parameters(a): Parameters<ArtifactArgs>) -> CallToolResult {
        answer(
            self.blocking(move |b, _| {
                let id = a.sandbox_id;
                let Some(path) = a.path.filter(|p| !p.is_empty()) else {
                    let list = b.call(call::CollectArtifacts { id }, Io::none())?;
                    let mut lines: Vec<String> = list
                        .iter()
                        .map(|x| format!("{} ({} bytes)", x.path, x.size))
                        .collect();
                    if lines.is_empty() {
                        lines.push("(no artifacts: write files under /workspace/outputs)".into());
                    }
                    return Ok(CallToolResult::success(vec![ContentBlock::text(
                        lines.join("\n"),
                    )]));
                };
                let path = path.trim_start_matches('/').to_string();
                let mut list = b.call(call::Artifacts { id: id.clone() }, Io::none())?;
                if !list.iter().any(|x| x.path == path) {
                    list = b.call(call::CollectArtifacts { id: id.clone() }, Io::none())?;
                }
                let Some(info) = list.iter().find(|x| x.path == path) else {
                    return Err(ToolError::Invalid(format!(
                        "sandbox {id} has no artifact {path:?} (list them without a path)"
                    )));
                };
                let uri = format!("sandbox://{id}/workspace/outputs/{path}");
                let bytes = Self::read_bounded(
                    b,
                    call::ReadArtifact {
                        id: id.clone(),
                        path: path.clone(),
                    },
                    &format!("artifact {path}"),
                    info.size,
                )?;
                Ok(CallToolResult::success(vec![file_content(
                    &path, &uri, bytes,
                )]))
            })
            .await,
        )
    }

    #[tool(
        description = "A PNG screenshot of the page open in a browser sandbox (template \
        `browser`, headless Chromium), as image content."
    )]
    async fn browser_screenshot(
        &self,
        Parameters(a): Parameters<ScreenshotArgs>,
    ) -> CallToolResult {
        match browser::capture(&self.state, &a.sandbox_id, None, a.full_page).await {
            Ok(png) => CallToolResult::success(vec![ContentBlock::image(
                base64::engine::general_purpose::STANDARD.encode(png),
                "image/png",
            )]),
            Err(resp) => ToolError::Screenshot(error_message(resp).await).into(),
        }
    }

    #[tool(
        description = "Pause a sandbox: its memory and disk go to a snapshot and it stops \
        using CPU and memory. Any later call (or resume_sandbox) resumes it, state intact."
    )]
    async fn pause_sandbox(&self, Parameters(a): Parameters<SandboxArgs>) -> CallToolResult {
        self.lifecycle(call::Pause { id: a.sandbox_id }).await
    }

    #[tool(description = "Resume a paused sandbox.")]
    async fn resume_sandbox(&self, Parameters(a): Parameters<SandboxArgs>) -> CallToolResult {
        self.lifecycle(call::Resume {
            id: a.sandbox_id,
            reboot: false,
        })
        .await
    }

    #[tool(description = "Kill a sandbox: its VM and disk are gone (artifacts stay).")]
    async fn kill_sandbox(&self, Parameters(a): Parameters<SandboxArgs>) -> CallToolResult {
        self.lifecycle(call::Kill { id: a.sandbox_id }).await
    }

    #[tool(
        description = "List sandboxes (live ones unless all): id, template, state, and when \
        each one's timeout ends, as JSON."
    )]
    async fn list_sandboxes(&self, Parameters(a): Parameters<ListArgs>) -> CallToolResult {
        let filter = ListFilter {
            all: a.all,
            ..Default::default()
        };
        answer(
            self.blocking(move |b, _| {
                let list = b.call(call::List { filter }, Io::none())?;
                let v: Vec<serde_json::Value> = list.iter().map(sandbox_json).collect();
                let v = serde_json::Value::Array(v);
                let mut r = CallToolResult::success(vec![ContentBlock::text(v.to_string())]);
                r.structured_content = Some(serde_json::json!({ "sandboxes": v }));
                Ok(r)
            })
            .await,
        )
    }
}

/// The message of an error response (`{"error":{"message"}}`), or its text.
async fn error_message(resp: axum::response::Response) -> String {
    let status = resp.status();
    let body = axum::body::to_bytes(resp.into_body(), 64 << 10)
        .await
        .unwrap_or_default();
    serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
        .unwrap_or_else(|| format!("{status}: {}", String::from_utf8_lossy(&body)))
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for EmberMcp {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("ember", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "ember sandboxes: isolated microVMs for running untrusted code. Create one \
                 with create_sandbox, then run_code / run_command / read_file / write_file \
                 with its sandbox_id; kill_sandbox when done (it is killed at its timeout \
                 anyway).",
            )
    }
}

/// The `/mcp` service: streamable HTTP, stateless, JSON responses.
pub fn service(state: AppState) -> StreamableHttpService<EmberMcp, LocalSessionManager> {
    let config = StreamableHttpServerConfig::default()
        .with_legacy_session_mode(false)
        .with_json_response(true)
        .with_sse_keep_alive(None)
        .disable_allowed_hosts()
        .with_max_request_body_bytes(MAX_REQUEST_BYTES);
    StreamableHttpService::new(
        move || Ok(EmberMcp::new(state.clone())),
        Arc::new(LocalSessionManager::default()),
        config,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(internet: bool, allow: &[&str], deny: &[&str]) -> NetworkArgs {
        NetworkArgs {
            internet,
            allow_out: allow.iter().map(|s| s.to_string()).collect(),
            deny_out: deny.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn network_arguments_map_onto_the_runtime_policy() {
        let p = network_policy(&net(false, &[], &[])).unwrap();
        assert_eq!(p.mode, NetMode::None);
        let p = network_policy(&net(true, &["10.1.2.0/24"], &["203.0.113.0/24"])).unwrap();
        assert_eq!(p.mode, NetMode::Egress);
        assert_eq!(p.allow_cidrs, ["10.1.2.0/24"]);
        assert_eq!(p.deny_cidrs, ["203.0.113.0/24"]);
        // Only listed addresses: everything else denied.
        let p = network_policy(&net(false, &["198.51.100.7"], &[])).unwrap();
        assert_eq!(p.mode, NetMode::Egress);
        assert_eq!(p.deny_cidrs, ["0.0.0.0/0"]);
        // Domains: the resolver's allow list does the restricting.
        let p = network_policy(&net(false, &["pypi.org", "*.example.com"], &[])).unwrap();
        assert_eq!(p.allow_domains, ["pypi.org", "*.example.com"]);
        assert!(p.deny_cidrs.is_empty());
        let e = network_policy(&net(true, &["pypi.org"], &[])).unwrap_err();
        assert!(e.to_string().contains("internet false"), "{e}");
        let e = network_policy(&net(false, &["10.0.0.1/8"], &[])).unwrap_err();
        assert!(e.to_string().starts_with("network.allow_out"), "{e}");
        let e = network_policy(&net(true, &[], &["nonsense"])).unwrap_err();
        assert!(e.to_string().contains("deny_cidrs"), "{e}");
    }

    #[test]
    fn limits_are_checked_by_name() {
        assert_eq!(run_limit(None).unwrap().as_secs(), DEFAULT_RUN_SECS);
        assert!(run_limit(Some(0)).is_err());
        assert!(run_limit(Some(MAX_RUN_SECS + 1))
            .unwrap_err()
            .to_string()
            .contains("over the limit"));
        let big = WriteFileArgs {
            sandbox_id: "sb".into(),
            path: "/tmp/big".into(),
            content: "x".repeat(MAX_FILE_BYTES as usize + 1),
            encoding: Encoding::Text,
        };
        let e = write_bytes(&big).unwrap_err().to_string();
        assert!(
            e.contains("/tmp/big") && e.contains("over the limit"),
            "{e}"
        );
        let b64 = WriteFileArgs {
            content: "aGVsbG8=".into(),
            encoding: Encoding::Base64,
            ..big.clone()
        };
        assert_eq!(write_bytes(&b64).unwrap(), b"hello");
        let bad = WriteFileArgs {
            content: "not base64!".into(),
            ..b64
        };
        assert!(write_bytes(&bad).is_err());
        assert!(check_path("relative/x").is_err());
        let mut w = Bounded {
            buf: vec![],
            limit: 4,
        };
        assert!(w.write_all(b"abcd").is_ok());
        assert!(w.write_all(b"e").is_err());
    }

    #[test]
    fn schemas_describe_the_arguments() {
        let tools = EmberMcp::tool_router().list_all();
        let names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
        for want in [
            "create_sandbox",
            "run_code",
            "run_command",
            "read_file",
            "write_file",
            "list_files",
            "download_artifact",
            "browser_screenshot",
            "pause_sandbox",
            "resume_sandbox",
            "kill_sandbox",
            "list_sandboxes",
        ] {
            assert!(names.contains(&want), "{want} missing from {names:?}");
        }
        for t in &tools {
            assert!(
                t.description.as_deref().is_some_and(|d| d.len() > 10),
                "{}",
                t.name
            );
        }
        let run = tools.iter().find(|t| t.name == "run_code").unwrap();
        let schema = serde_json::Value::Object((*run.input_schema).clone());
        assert_eq!(
            schema["required"],
            serde_json::json!(["sandbox_id", "code"])
        );
        assert!(schema["properties"]["code"]["description"].is_string());
        let create = tools.iter().find(|t| t.name == "create_sandbox").unwrap();
        let text = serde_json::to_string(&create.input_schema).unwrap();
        assert!(
            text.contains("allow_out") && text.contains("internet"),
            "{text}"
        );
        // Unknown arguments are refused, not ignored.
        assert!(serde_json::from_value::<RunCodeArgs>(
            serde_json::json!({"sandbox_id": "a", "code": "1", "lang": "py"})
        )
        .is_err());
    }

    #[test]
    fn code_output_maps_to_content() {
        let mut out = CodeOutput::default();
        out.take(&EventKind::Stdout {
            data: b"hi\n".to_vec(),
        });
        out.take(&EventKind::Stderr {
            data: b"warn\n".to_vec(),
        });
        let mut png = serde_json::Map::new();
        png.insert("image/png".into(), "iVBO\nRw==".into());
        png.insert("text/plain".into(), "<Figure>".into());
        out.items.push(png);
        let mut text = serde_json::Map::new();
        text.insert("text/plain".into(), "42".into());
        text.insert("text/html".into(), "<b>42</b>".into());
        out.items.push(text);
        let end = RunEnd {
            status: EndStatus::Ok,
            execution_count: Some(1),
            duration_ms: Some(3),
        };
        let r = code_result(&out, &end, Duration::from_secs(5));
        assert_eq!(r.is_error, Some(false));
        let v = serde_json::to_value(&r.content).unwrap();
        assert_eq!(v[0]["text"], "hi\n");
        assert_eq!(v[1]["text"], "[stderr]\nwarn\n");
        assert_eq!(v[2]["type"], "image");
        assert_eq!(v[2]["data"], "iVBORw==");
        assert_eq!(v[2]["mimeType"], "image/png");
        assert_eq!(v[3]["text"], "42");
        assert_eq!(v.as_array().unwrap().len(), 4);

        let mut out = CodeOutput::default();
        out.take(&EventKind::Exception(Exception {
            name: "ZeroDivisionError".into(),
            value: "division by zero".into(),
            traceback: vec!["\u{1b}[0;31mline 1\u{1b}[0m".into()],
        }));
        let end = RunEnd {
            status: EndStatus::Error,
            execution_count: None,
            duration_ms: None,
        };
        let r = code_result(&out, &end, Duration::from_secs(5));
        assert_eq!(r.is_error, Some(true));
        let v = serde_json::to_value(&r.content).unwrap();
        assert_eq!(
            v[0]["text"],
            "[error]\nZeroDivisionError: division by zero\nline 1"
        );
    }

    #[test]
    fn command_output_maps_to_content() {
        let mut out = CodeOutput::default();
        out.take(&EventKind::Stdout {
            data: b"ok".to_vec(),
        });
        out.take(&EventKind::Exit(ExitStatus::Code(3)));
        let r = command_result(&out, EndStatus::Ok, Duration::from_secs(1));
        assert_eq!(r.is_error, Some(true));
        let v = serde_json::to_value(&r.content).unwrap();
        assert_eq!(v[1]["text"], "[exited with status 3]");
        let mut out = CodeOutput::default();
        out.take(&EventKind::Exit(ExitStatus::Code(0)));
        assert_eq!(
            command_result(&out, EndStatus::Ok, Duration::from_secs(1)).is_error,
            Some(false)
        );
        // Output past the cap is dropped and counted.
        let mut out = CodeOutput::default();
        out.take(&EventKind::Stdout {
            data: vec![b'a'; OUTPUT_CAP as usize + 10],
        });
        assert_eq!(out.stdout.len() as u64, OUTPUT_CAP);
        assert_eq!(out.dropped, 10);
    }

    #[test]
    fn files_map_to_text_image_or_blob() {
        let v = |c: ContentBlock| serde_json::to_value(c).unwrap();
        assert_eq!(
            v(file_content("/a.txt", "u", b"hello".to_vec()))["text"],
            "hello"
        );
        let img = v(file_content("/a.PNG", "u", vec![0x89, b'P']));
        assert_eq!(img["type"], "image");
        assert_eq!(img["mimeType"], "image/png");
        let blob = v(file_content(
            "/a.bin",
            "sandbox://x/a.bin",
            vec![0xff, 0xfe],
        ));
        assert_eq!(blob["type"], "resource");
        assert_eq!(blob["resource"]["blob"], "//4=");
        assert_eq!(blob["resource"]["uri"], "sandbox://x/a.bin");
        assert_eq!(blob["resource"]["mimeType"], "application/octet-stream");
    }

    #[test]
    fn runtime_errors_are_tool_errors_with_the_runtime_message() {
        let r: CallToolResult = ToolError::from(RuntimeError::NotFound("abc".into())).into();
        assert_eq!(r.is_error, Some(true));
        let v = serde_json::to_value(&r.content).unwrap();
        assert_eq!(v[0]["text"], "no sandbox abc");
    }
}
