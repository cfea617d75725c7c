//! What a routed E2B request carries to its handler: the sandbox it was routed to, and how a
//! runtime error on that sandbox reads (one that ended meanwhile is "gone"). Shared by the
//! router (`route`) and the surfaces it dispatches to (`envd`, `interp`).

use ember_runtime::{RuntimeError, SandboxInfo};

use super::E2bError;

/// The sandbox a request was routed to, as a request extension for the handlers.
#[derive(Debug, Clone)]
pub struct Target {
    /// The sandbox id.
    pub id: String,
    /// What the runtime knows of it (live: running, or paused/resuming for calls that
    /// resume it).
    pub info: SandboxInfo,
}

/// Maps a runtime error of a call on a sandbox that was found live a moment ago: one that
/// ended meanwhile is "not found" (502), as for a request that arrives after its end.
pub fn gone_or(id: &str, e: RuntimeError) -> E2bError {
    match &e {
        RuntimeError::NotFound(_) => E2bError::sandbox_gone(id),
        RuntimeError::Conflict { state, .. } if matches!(*state, "stopped" | "failed") => {
            E2bError::sandbox_gone(id)
        }
        _ => E2bError::from(e),
    }
}
