//! `ember mcp`: an MCP server on stdio for a local agent, in front of a running `ember serve`
//! or `ember gateway` (`EMBER_URL`, `EMBER_TOKEN`).
//!
//! The tools are the server's (`/mcp`, `ember_server::mcp`): `tools/list` and `tools/call`
//! are forwarded to it with the SDK's streamable HTTP client, never implemented here again.
//! One tool is added, `upload_file`, which only makes sense on the agent's machine: it reads
//! a local file (at most [`MAX_UPLOAD_BYTES`]) and sends it as the server's `write_file`.
//!
//! The sandboxes created through it (the `sandbox_id` of each `create_sandbox` result) are
//! killed when it exits — stdin closed, SIGINT or SIGTERM —, unless the agent killed them
//! already. Killed hard (SIGKILL), it leaves them to their timeout.

use std::collections::BTreeSet;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine;
use clap::Args;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
    JsonObject, ListToolsResult, PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::{RequestContext, RoleClient, RunningService};
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::{ErrorData, Peer, RoleServer, ServerHandler, ServiceExt};
use serde::Deserialize;

use crate::remote::Conn;

/// Largest local file `upload_file` sends (the server's `write_file` limit).
pub const MAX_UPLOAD_BYTES: u64 = ember_server::mcp::MAX_FILE_BYTES;
/// How long the sandboxes' kills may take at exit, together.
const KILL_GRACE: Duration = Duration::from_secs(15);

/// `ember mcp`.
#[derive(Debug, Args)]
#[command(after_help = CLIENT_CONFIG)]
pub struct McpArgs {
    #[command(flatten)]
    conn: Conn,
    /// Leave the sandboxes created through this server running when it exits (their
    /// timeout still applies).
    #[arg(long)]
    keep_sandboxes: bool,
}

const CLIENT_CONFIG: &str = "\
Serves MCP on stdin/stdout for a local agent; the tools run on the ember server at EMBER_URL
(`ember serve` or `ember gateway`), authenticated with EMBER_TOKEN (default: the server's
token file, $EMBER_HOME/token). Sandboxes created through it are killed when it exits.

Configure it in an MCP client (Claude Desktop, Cursor, ...):

  {
    \"mcpServers\": {
      \"ember\": {
        \"command\": \"ember\",
        \"args\": [\"mcp\"],
        \"env\": {
          \"EMBER_URL\": \"http://127.0.0.1:7070\",
          \"EMBER_TOKEN\": \"<the server's token>\"
        }
      }
    }
  }

A client that speaks streamable HTTP can use the server's /mcp directly instead, with the
header `Authorization: Bearer <token>` (no upload_file there, and no clean-up at exit).";

/// Why `ember mcp` stopped.
#[derive(Debug, thiserror::Error)]
pub enum McpError {
    /// The server's URL cannot be used.
    #[error("{0}")]
    Url(String),
    /// The server's /mcp did not answer the handshake.
    #[error("cannot reach the MCP endpoint {url}: {message}")]
    Connect {
        /// The endpoint.
        url: String,
        /// Why.
        message: String,
    },
    /// The stdio side failed.
    #[error("serving MCP on stdio: {0}")]
    Serve(String),
    /// The async runtime could not start.
    #[error("cannot start the async runtime: {0}")]
    Runtime(std::io::Error),
}

/// `upload_file`'s arguments.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct UploadArgs {
    /// The sandbox's id.
    pub sandbox_id: String,
    /// The file on this machine (where the agent runs).
    pub local_path: String,
    /// Absolute destination path in the sandbox.
    pub path: String,
}

fn upload_tool() -> Tool {
    Tool::new(
        "upload_file",
        "Copy a file from this machine (where the agent runs) into a sandbox, at most 8 MiB.",
        rmcp::handler::server::tool::schema_for_type::<UploadArgs>(),
    )
}

/// Reads `a.local_path` (at most [`MAX_UPLOAD_BYTES`]) into the arguments of the server's
/// `write_file`.
pub fn upload_request(a: &UploadArgs) -> Result<JsonObject, String> {
    let meta = std::fs::metadata(&a.local_path).map_err(|e| format!("{}: {e}", a.local_path))?;
    if !meta.is_file() {
        return Err(format!("{} is not a regular file", a.local_path));
    }
    if meta.len() > MAX_UPLOAD_BYTES {
        return Err(format!(
            "{} is {} bytes, over the limit of {MAX_UPLOAD_BYTES} bytes",
            a.local_path,
            meta.len()
        ));
    }
    let bytes = std::fs::read(&a.local_path).map_err(|e| format!("{}: {e}", a.local_path))?;
    if bytes.len() as u64 > MAX_UPLOAD_BYTES {
        return Err(format!(
            "{} grew past the limit of {MAX_UPLOAD_BYTES} bytes",
            a.local_path
        ));
    }
    let v = serde_json::json!({
        "sandbox_id": a.sandbox_id,
        "path": a.path,
        "content": base64::engine::general_purpose::STANDARD.encode(bytes),
        "encoding": "base64",
    });
    match v {
        serde_json::Value::Object(m) => Ok(m),
        _ => Err("internal: arguments are not an object".into()),
    }
}

/// The sandbox a `create_sandbox` result names.
pub fn created_id(r: &CallToolResult) -> Option<String> {
    if r.is_error == Some(true) {
        return None;
    }
    let from = |v: &serde_json::Value| v["sandbox_id"].as_str().map(str::to_string);
    r.structured_content.as_ref().and_then(from).or_else(|| {
        r.content.iter().find_map(|c| {
            let t = c.as_text()?;
            from(&serde_json::from_str(&t.text).ok()?)
        })
    })
}

fn tool_error(msg: impl Into<String>) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(msg.into())])
}

/// The stdio server: forwards to the upstream `/mcp` and remembers what it created.
struct Forwarder {
    upstream: Peer<RoleClient>,
    created: Arc<Mutex<BTreeSet<String>>>,
}

impl Forwarder {
    fn created(&self) -> std::sync::MutexGuard<'_, BTreeSet<String>> {
        self.created.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn forward(&self, name: &str, args: Option<JsonObject>) -> CallToolResult {
        let mut params = CallToolRequestParams::new(name.to_string());
        if let Some(a) = args {
            params = params.with_arguments(a);
        }
        match self.upstream.call_tool(params).await {
            Ok(r) => r,
            Err(e) => tool_error(format!("the ember server's {name} failed: {e}")),
        }
    }
}

impl ServerHandler for Forwarder {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("ember-mcp", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "ember sandboxes: isolated microVMs for running untrusted code. Create one \
                 with create_sandbox, then run_code / run_command / read_file / write_file / \
                 upload_file with its sandbox_id. Sandboxes created here are killed when this \
                 server exits.",
            )
    }

    async fn list_tools(
        &self,
        request: Option<PaginatedRequestParams>,
        _: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let mut r = self.upstream.list_tools(request).await.map_err(|e| {
            ErrorData::internal_error(format!("the ember server's tools/list failed: {e}"), None)
        })?;
        if r.next_cursor.is_none() {
            r.tools.push(upload_tool());
        }
        Ok(r)
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        _: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let name = request.name.to_string();
        let args = request.arguments;
        let result = match name.as_str() {
            "upload_file" => {
                let a = serde_json::Value::Object(args.unwrap_or_default());
                match serde_json::from_value::<UploadArgs>(a)
                    .map_err(|e| format!("upload_file: {e}"))
                    .and_then(|a| upload_request(&a))
                {
                    Ok(w) => self.forward("write_file", Some(w)).await,
                    Err(e) => tool_error(e),
                }
            }
            "create_sandbox" => {
                let r = self.forward(&name, args).await;
                if let Some(id) = created_id(&r) {
                    self.created().insert(id);
                }
                r
            }
            "kill_sandbox" => {
                let id = args
                    .as_ref()
                    .and_then(|a| a.get("sandbox_id"))
                    .and_then(|v| v.as_str())
                    .map(str::to_string);
                let r = self.forward(&name, args).await;
                if let (Some(id), false) = (id, r.is_error == Some(true)) {
                    self.created().remove(&id);
                }
                r
            }
            _ => self.forward(&name, args).await,
        };
        Ok(result.into())
    }
}

/// Runs `ember mcp`.
pub fn main(a: McpArgs) -> ExitCode {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // stdout is the protocol: logs go to stderr.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return crate::fail(McpError::Runtime(e)),
    };
    let r = rt.block_on(run(a));
    rt.shutdown_timeout(Duration::from_secs(1));
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => crate::fail(e),
    }
}

/// The `/mcp` endpoint of the server at `url`.
pub fn endpoint(url: &str) -> Result<String, McpError> {
    let url = url.trim_end_matches('/');
    if url.starts_with("https://") {
        return Err(McpError::Url(format!(
            "{url}: `ember mcp` speaks plain HTTP to the server (run it next to `ember serve` \
             or `ember gateway`, or give their http:// address)"
        )));
    }
    if !url.starts_with("http://") {
        return Err(McpError::Url(format!(
            "{url}: not an http:// URL (EMBER_URL)"
        )));
    }
    Ok(format!("{url}/mcp"))
}

async fn run(a: McpArgs) -> Result<(), McpError> {
    let client = a.conn.client();
    let url = endpoint(client.url())?;
    let mut config = StreamableHttpClientTransportConfig::with_uri(url.clone());
    if let Some(t) = client.token() {
        config = config.auth_header(t.to_string());
    }
    // A read_file of 8 MiB is ~11 MiB of base64 in JSON.
    config.max_json_response_size = 32 << 20;
    let transport = StreamableHttpClientTransport::from_config(config);
    let upstream: RunningService<RoleClient, ()> =
        ().serve(transport).await.map_err(|e| McpError::Connect {
            url: url.clone(),
            message: e.to_string(),
        })?;
    let created = Arc::new(Mutex::new(BTreeSet::new()));
    let fwd = Forwarder {
        upstream: upstream.peer().clone(),
        created: created.clone(),
    };
    let served = fwd
        .serve(rmcp::transport::stdio_pipes())
        .await
        .map_err(|e| McpError::Serve(e.to_string()));
    let stop_reason = match served {
        Ok(server) => {
            let token = server.cancellation_token();
            let why = tokio::select! {
                r = server.waiting() => match r {
                    Ok(_) => "stdin closed".to_string(),
                    Err(e) => format!("the stdio server stopped: {e}"),
                },
                _ = ember_server::shutdown_signal() => {
                    token.cancel();
                    "signal".to_string()
                }
            };
            Ok(why)
        }
        Err(e) => Err(e),
    };
    let ids: Vec<String> = created
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .cloned()
        .collect();
    if !a.keep_sandboxes && !ids.is_empty() {
        tracing::info!(
            "exiting ({}): killing {} sandbox(es)",
            stop_reason.as_deref().unwrap_or("error"),
            ids.len()
        );
        let peer = upstream.peer().clone();
        let kills = ids.into_iter().map(|id| {
            let peer = peer.clone();
            async move {
                let mut args = JsonObject::new();
                args.insert("sandbox_id".into(), id.clone().into());
                let r = peer
                    .call_tool(CallToolRequestParams::new("kill_sandbox").with_arguments(args))
                    .await;
                match r {
                    Ok(r) if r.is_error != Some(true) => {}
                    Ok(r) => tracing::warn!("kill {id}: {:?}", r.content),
                    Err(e) => tracing::warn!("kill {id}: {e}"),
                }
            }
        });
        let all = futures_join_all(kills);
        if tokio::time::timeout(KILL_GRACE, all).await.is_err() {
            eprintln!("ember mcp: some sandboxes were not killed within {KILL_GRACE:?}; their timeout applies");
        }
    }
    let _ = upstream.cancel().await;
    stop_reason.map(|_| ())
}

/// Runs the futures concurrently to their ends.
async fn futures_join_all<F: std::future::Future<Output = ()> + Send + 'static>(
    fs: impl Iterator<Item = F>,
) {
    let handles: Vec<_> = fs.map(tokio::spawn).collect();
    for h in handles {
        let _ = h.await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_endpoint_is_the_servers_mcp_path() {
        assert_eq!(
            endpoint("http://127.0.0.1:7070/").unwrap(),
            "http://127.0.0.1:7070/mcp"
        );
        assert!(endpoint("https://x")
            .unwrap_err()
            .to_string()
            .contains("plain HTTP"));
        assert!(endpoint("ftp://x").is_err());
    }

    #[test]
    fn uploads_are_read_and_capped() {
        let dir = tempfile::tempdir().unwrap();
        let small = dir.path().join("small.bin");
        std::fs::write(&small, [0u8, 1, 2, 255]).unwrap();
        let a = UploadArgs {
            sandbox_id: "sb".into(),
            local_path: small.display().to_string(),
            path: "/workspace/x".into(),
        };
        let w = upload_request(&a).unwrap();
        assert_eq!(w["content"], "AAEC/w==");
        assert_eq!(w["encoding"], "base64");
        assert_eq!(w["path"], "/workspace/x");
        let big = dir.path().join("big.bin");
        let f = std::fs::File::create(&big).unwrap();
        f.set_len(MAX_UPLOAD_BYTES + 1).unwrap();
        let e = upload_request(&UploadArgs {
            local_path: big.display().to_string(),
            ..a.clone()
        })
        .unwrap_err();
        assert!(e.contains("big.bin") && e.contains("over the limit"), "{e}");
        let e = upload_request(&UploadArgs {
            local_path: dir.path().display().to_string(),
            ..a
        })
        .unwrap_err();
        assert!(e.contains("not a regular file"), "{e}");
        let schema = serde_json::to_string(&upload_tool().input_schema).unwrap();
        assert!(schema.contains("local_path"), "{schema}");
    }

    #[test]
    fn created_sandboxes_are_found_in_results() {
        let mut r = CallToolResult::success(vec![ContentBlock::text(
            r#"{"sandbox_id":"abc","state":"running"}"#,
        )]);
        assert_eq!(created_id(&r).as_deref(), Some("abc"));
        r.structured_content = Some(serde_json::json!({"sandbox_id": "def"}));
        assert_eq!(created_id(&r).as_deref(), Some("def"));
        let e = CallToolResult::error(vec![ContentBlock::text("no template x")]);
        assert_eq!(created_id(&e), None);
    }
}
