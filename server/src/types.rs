//! The API's own request and response bodies: what the runtime's types do not already
//! cover (its `*Request`/`*Info` types are used as they are), and the agent protocol's types
//! restated with OpenAPI schemas and `deny_unknown_fields`.

use std::collections::BTreeMap;

use base64::Engine;
use ember_runtime::call::{
    ContextInfo, DirEntry, ExecRequest, ExecUser, FileStat, FileType, RunCodeRequest,
};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::error::ApiError;
use ember_runtime::{AuditFilter, OnTimeout};

pub use super::error::{ErrorBody, ErrorDetail};

/// `{"ok": true}`: the answer of calls that return nothing else.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct OkBody {
    /// Always true.
    pub ok: bool,
}

impl OkBody {
    /// `{"ok": true}`.
    pub const YES: OkBody = OkBody { ok: true };
}

/// One line of an `application/x-ndjson` stream: an agent event as the guest produced it
/// (`stdout`/`stderr` with base64 `data`, `result`, `display`, `exception`, `exit`, …; see
/// `agent/PROTOCOL.md`), then one final `{"type":"end", …}` or
/// `{"type":"error","error":{"code","message"}}`. Template builds send `step`, `output`,
/// `up_to_date`, then `done` or `error`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct StreamLine {
    /// The line's type.
    #[serde(rename = "type")]
    pub kind: String,
}

pub use ember_runtime::{TemplateSummary, VmShapeInfo};

/// Body of `POST /v1/templates/{name}/build` (may be empty).
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BuildBody {
    /// Build again even if a build with the same inputs exists.
    #[serde(default)]
    pub rebuild: bool,
}

/// Body of `POST /v1/sandboxes/{id}/timeout`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TimeoutBody {
    /// The new timeout, seconds from now.
    pub timeout_secs: u64,
    /// What the timeout does (default: unchanged).
    #[serde(default)]
    pub on_timeout: Option<OnTimeout>,
}

/// Body of `POST /v1/sandboxes/{id}/resume` (optional).
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResumeBody {
    /// Boot from the sandbox's disk alone, ignoring the memory of its pause (default `false`):
    /// its processes and interpreter state are lost, its files kept. The rescue path for a
    /// pause whose memory no longer restores (a template rebuilt with another kernel).
    #[serde(default)]
    pub reboot: bool,
}

fn python() -> String {
    "python".into()
}

/// Body of `POST /v1/sandboxes/{id}/contexts`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ContextBody {
    /// `python` (default), `bash`, `javascript` (`js`), `typescript` (`ts`), `r` or `java`
    /// (the template must have it: else 400 with the languages it has).
    #[serde(default = "python")]
    pub language: String,
    /// Working directory (default `/`).
    #[serde(default)]
    pub cwd: Option<String>,
}

/// A code context in a sandbox.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ContextOut {
    /// Its id.
    pub id: String,
    /// `python`, `bash`, `javascript`, `typescript`, `r` or `java`.
    pub language: String,
    /// Its working directory when it started.
    pub cwd: String,
    /// Its process's pid in the guest (0 while it has none).
    pub pid: i32,
    /// Whether code is running in it (listings only).
    pub busy: Option<bool>,
}

impl From<ContextInfo> for ContextOut {
    fn from(c: ContextInfo) -> Self {
        let ContextInfo {
            id,
            language,
            cwd,
            pid,
            busy,
        } = c;
        ContextOut {
            id,
            language,
            cwd,
            pid,
            busy,
        }
    }
}

/// Body of `POST /v1/sandboxes/{id}/code`: `run_code` of the agent protocol.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RunCodeBody {
    /// The code.
    pub code: String,
    /// The context (default `default` for python, `default-bash` for bash; created on
    /// first use).
    #[serde(default)]
    pub context: Option<String>,
    /// The language when no context is named: `python` (default), `bash`, `javascript`
    /// (`js`), `typescript` (`ts`), `r` or `java` (the template must have it).
    #[serde(default)]
    pub language: Option<String>,
    /// Time limit in milliseconds (then SIGINT, and a kill 2 s later); capped by the server.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Environment variables for this call only.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Most stdout + stderr + display bytes sent; capped by the server.
    #[serde(default)]
    pub output_cap: Option<u64>,
}

impl From<RunCodeBody> for RunCodeRequest {
    fn from(b: RunCodeBody) -> Self {
        RunCodeRequest {
            context: b.context,
            language: b.language,
            code: b.code,
            timeout_ms: b.timeout_ms,
            env: b.env,
            output_cap: b.output_cap,
            // The warm pool's priming cell only: not part of the API.
            silent: false,
        }
    }
}

/// Who a program runs as.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ExecUserBody {
    /// uid 0.
    #[default]
    Root,
    /// The unprivileged account `user` (uid 1000 in the templates).
    User,
}

/// Body of `POST /v1/sandboxes/{id}/exec`: `exec` of the agent protocol.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecBody {
    /// Program and arguments (a name without `/` is looked up in `PATH`).
    pub argv: Vec<String>,
    /// Variables on top of the sandbox's environment.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory (default `/`).
    #[serde(default)]
    pub cwd: Option<String>,
    /// Bytes for the program's stdin, base64 (without it stdin is `/dev/null`).
    #[serde(default)]
    pub stdin: Option<String>,
    /// Time limit in milliseconds (then the process group is killed); capped by the server.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Return at once after `started` (the program keeps running in the guest).
    #[serde(default)]
    pub background: bool,
    /// Who it runs as.
    #[serde(default)]
    pub user: ExecUserBody,
}

impl ExecBody {
    /// The agent's request; refuses an empty argv or bad base64.
    pub fn into_request(self) -> Result<ExecRequest, ApiError> {
        if self.argv.is_empty() || self.argv[0].is_empty() {
            return Err(ApiError::invalid("argv must name a program"));
        }
        let stdin = match self.stdin {
            Some(s) => Some(
                base64::engine::general_purpose::STANDARD
                    .decode(s.trim())
                    .map_err(|e| ApiError::invalid(format!("stdin is not base64: {e}")))?,
            ),
            None => None,
        };
        Ok(ExecRequest {
            argv: self.argv,
            env: self.env,
            cwd: self.cwd,
            stdin,
            timeout_ms: self.timeout_ms,
            background: self.background,
            stdin_stream: false,
            pty: None,
            user: match self.user {
                ExecUserBody::Root => ExecUser::Root,
                ExecUserBody::User => ExecUser::User,
            },
        })
    }
}

fn file_type(t: FileType) -> String {
    match t {
        FileType::File => "file",
        FileType::Dir => "dir",
        FileType::Symlink => "symlink",
        FileType::Other => "other",
    }
    .into()
}

/// One entry of a guest directory listing.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct EntryOut {
    /// Absolute guest path.
    pub path: String,
    /// The last path component.
    pub name: String,
    /// `file`, `dir`, `symlink` or `other` (links are not followed).
    #[serde(rename = "type")]
    pub kind: String,
    /// Size in bytes.
    pub size: u64,
    /// `st_mode`.
    pub mode: u32,
    /// Last modification, milliseconds since the Unix epoch.
    pub mtime_ms: i64,
}

impl From<DirEntry> for EntryOut {
    fn from(e: DirEntry) -> Self {
        let DirEntry {
            path,
            name,
            kind,
            size,
            mode,
            mtime_ms,
        } = e;
        EntryOut {
            path,
            name,
            kind: file_type(kind),
            size,
            mode,
            mtime_ms,
        }
    }
}

/// Metadata of a guest path.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct StatOut {
    /// Absolute guest path.
    pub path: String,
    /// `file`, `dir`, `symlink` or `other`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Size in bytes.
    pub size: u64,
    /// `st_mode`.
    pub mode: u32,
    /// Last modification, milliseconds since the Unix epoch.
    pub mtime_ms: i64,
}

impl From<FileStat> for StatOut {
    fn from(s: FileStat) -> Self {
        let FileStat {
            path,
            kind,
            size,
            mode,
            mtime_ms,
        } = s;
        StatOut {
            path,
            kind: file_type(kind),
            size,
            mode,
            mtime_ms,
        }
    }
}

/// Answer of an upload.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct WrittenOut {
    /// The guest path written.
    pub path: String,
    /// Bytes written.
    pub bytes: u64,
}

/// `?path=`: a guest path.
#[derive(Debug, Clone, Serialize, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct PathQuery {
    /// Absolute guest path.
    pub path: String,
}

/// `?path=&depth=`.
#[derive(Debug, Clone, Serialize, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// Absolute guest path of a directory.
    pub path: String,
    /// Levels to descend (default 1, at most 64).
    #[serde(default)]
    pub depth: Option<u32>,
}

/// `?path=&recursive=`.
#[derive(Debug, Clone, Serialize, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct RemoveQuery {
    /// Absolute guest path.
    pub path: String,
    /// Remove a directory with everything in it.
    #[serde(default)]
    pub recursive: bool,
}

/// Body of `POST .../files/mkdir`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MkdirBody {
    /// Directory to create, with its parents.
    pub path: String,
}

/// Body of `POST .../files/rename`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RenameBody {
    /// Current guest path.
    pub from: String,
    /// New guest path.
    pub to: String,
}

/// `GET /v1/audit` filters.
#[derive(Debug, Clone, Default, Serialize, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct AuditQuery {
    /// Only this sandbox's records.
    #[serde(default)]
    pub sandbox: Option<String>,
    /// Only this call (`create`, `run_code`, `exec`, `file_write`, …).
    #[serde(default)]
    pub call: Option<String>,
    /// Only `ok`, or only this error code.
    #[serde(default)]
    pub outcome: Option<String>,
    /// Only records with a sequence number above this.
    #[serde(default)]
    pub after: Option<i64>,
    /// At most this many (default 1000; the newest last).
    #[serde(default)]
    pub limit: Option<usize>,
}

/// `GET /v1/sandboxes/{id}/audit` filters.
#[derive(Debug, Clone, Default, Serialize, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct SandboxAuditQuery {
    /// Only this call.
    #[serde(default)]
    pub call: Option<String>,
    /// Only `ok`, or only this error code.
    #[serde(default)]
    pub outcome: Option<String>,
    /// Only records with a sequence number above this.
    #[serde(default)]
    pub after: Option<i64>,
    /// At most this many (default 1000; the newest last).
    #[serde(default)]
    pub limit: Option<usize>,
}

impl From<AuditQuery> for AuditFilter {
    fn from(q: AuditQuery) -> Self {
        AuditFilter {
            sandbox: q.sandbox,
            call: q.call,
            outcome: q.outcome,
            after: q.after,
            limit: q.limit,
        }
    }
}

impl SandboxAuditQuery {
    /// The filter for sandbox `id`.
    pub fn filter(self, id: String) -> AuditFilter {
        AuditFilter {
            sandbox: Some(id),
            call: self.call,
            outcome: self.outcome,
            after: self.after,
            limit: self.limit,
        }
    }
}
