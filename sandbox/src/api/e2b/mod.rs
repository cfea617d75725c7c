//! The E2B-compatible surface of `ember serve`: the official E2B SDKs (Python `e2b`,
//! `e2b-code-interpreter`; npm `e2b`, `@e2b/code-interpreter`) work unchanged against it.
//! The wire protocol is summarised in `docs/e2b.md`; the SDK source is the contract.
//!
//! Everything is translated in the host process to [`Backend`] calls (the runtime) and the
//! guest agent's protocol; nothing of E2B's own server code runs in the guest.
//!
//! - `control`: the REST control plane (`/v2/sandboxes`, `/sandboxes/…`, `/snapshots`),
//!   authenticated by `X-API-KEY` (ember's token), errors `{"code": int, "message": str}`.
//! - `route`: which requests are sandbox traffic (`E2b-Sandbox-Id`/`E2b-Sandbox-Port`
//!   headers, or `Host: <port>-<id>.<domain>`), and the per-sandbox `X-Access-Token`.
//! - `envd`: the envd HTTP surface on port 49983 (`/health`, `/files`, `/envs`).
//! - `connect` + `rpc`: Connect RPC (JSON codec) for `process.Process` and
//!   `filesystem.Filesystem` on port 49983.
//! - `interp`: the code-interpreter surface on port 49999 (`/execute`, `/contexts`).
//! - `tls`: the optional TLS listener and the local CA / `*.<domain>` certificate.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::{AppState, Backend};

pub mod rpc;
pub mod tls;

/// envd's port: files, processes, filesystem RPC.
pub const ENVD_PORT: u16 = 49983;
/// The code interpreter's port: `/execute`, `/contexts`.
pub const INTERP_PORT: u16 = 49999;

/// The envd version advertised to the SDKs. The SDKs gate features on it
/// (`e2b/envd/versions.py`): 0.3.0 stdin flag, 0.4.0 default user, 0.5.2 CloseStdin,
/// 0.5.7 octet-stream and gzip uploads. Nothing above 0.5.7 is claimed (file metadata as
/// xattrs, watch `include_entry` are not implemented).
pub const ENVD_VERSION: &str = "0.5.7";

/// The E2B surface's settings.
#[derive(Debug, Clone)]
pub struct E2bOptions {
    /// The sandbox domain for `Host: <port>-<id>.<domain>` routing and the `domain` field of
    /// responses (None: answer `"domain": null`, header routing only).
    pub domain: Option<String>,
    /// E2B template names → ember template names (`code-interpreter-v1` → `python-data`,
    /// `base` → `default` unless configured otherwise). Names not in the map are ember
    /// template names.
    pub aliases: BTreeMap<String, String>,
}

impl Default for E2bOptions {
    fn default() -> Self {
        let mut aliases = BTreeMap::new();
        aliases.insert("code-interpreter-v1".into(), "python-data".into());
        aliases.insert("base".into(), "default".into());
        E2bOptions {
            domain: None,
            aliases,
        }
    }
}

/// State shared by the E2B handlers. Cheap to clone.
#[derive(Clone)]
pub struct E2bState {
    /// The server's state (backend, token, blocking-call helpers).
    pub app: AppState,
    /// Settings.
    pub opts: Arc<E2bOptions>,
    /// The RPC services' state (process tags and configs, watchers).
    pub rpc: Arc<rpc::RpcState>,
}

impl std::fmt::Debug for E2bState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("E2bState").finish_non_exhaustive()
    }
}

impl E2bState {
    /// The backend.
    pub fn backend(&self) -> Arc<dyn Backend> {
        self.app.backend()
    }
}
