//! Errors of the runtime, each with a stable code (the API's `error.code`) and a class that
//! says whose fault it is (the API maps it to a 4xx or 5xx status).

use std::path::PathBuf;

use ember_agent::client::ClientError;
use ember_agent::protocol::ErrorCode;

use super::types::State;
use crate::{SandboxError, TemplateError};

/// Whose fault an error is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// The request names something that does not exist (404).
    NotFound,
    /// The request is malformed or out of bounds (400).
    Invalid,
    /// The sandbox is in a state that does not allow the call (409).
    Conflict,
    /// The server is at capacity (429/503-like; the API uses 429).
    Capacity,
    /// The call timed out (504).
    Timeout,
    /// The guest refused or failed the call (the call reached the sandbox; 422).
    Guest,
    /// A service the call needs is away for now (a fleet's directory); retry (503).
    Unavailable,
    /// A fault of the host or the runtime (500).
    Internal,
}

/// An error of a runtime call.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// No sandbox has that id.
    #[error("no sandbox {0}")]
    NotFound(String),
    /// No template or snapshot by that name.
    #[error("{0}")]
    NoSuchImage(String),
    /// No named snapshot by that name.
    #[error("{0}")]
    NoSuchSnapshot(String),
    /// No artifact at that path.
    #[error("{0}")]
    NoSuchArtifact(String),
    /// No polling watcher by that id in that sandbox.
    #[error("{0}")]
    NoSuchWatcher(String),
    /// The request is invalid.
    #[error("{0}")]
    Invalid(String),
    /// The secrets store refused or failed.
    #[error(transparent)]
    Secret(#[from] crate::secrets::SecretError),
    /// A volume call refused or failed.
    #[error(transparent)]
    Volume(#[from] crate::volumes::VolumeError),
    /// The caller went away; the work in the guest was stopped.
    #[error("{0}")]
    Cancelled(String),
    /// The sandbox's state does not allow the call.
    #[error("sandbox {id} is {state}: {message}")]
    Conflict {
        /// The sandbox.
        id: String,
        /// Its state.
        state: &'static str,
        /// Why the call is refused.
        message: String,
    },
    /// A server-wide cap would be exceeded.
    #[error("capacity: {0}")]
    Capacity(String),
    /// The guest answered with an error (file not found, no such context, …).
    #[error("sandbox {id}: {call}: {message}")]
    Guest {
        /// The sandbox.
        id: String,
        /// The call.
        call: &'static str,
        /// The agent's error code.
        code: ErrorCode,
        /// The agent's message.
        message: String,
    },
    /// The call did not finish in time.
    #[error("sandbox {id}: {message}")]
    Timeout {
        /// The sandbox.
        id: String,
        /// What timed out.
        message: String,
    },
    /// The sandbox's VM failed (transport error, VMM died).
    #[error(transparent)]
    Sandbox(SandboxError),
    /// A template could not be opened or built.
    #[error(transparent)]
    Template(#[from] TemplateError),
    /// The durable store failed.
    #[error("store: {0}")]
    Store(#[from] rusqlite::Error),
    /// A host file operation failed.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// On which path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A guest port did not accept a connection (nothing listens, or it refused).
    #[error("{0}")]
    Unreachable(String),
    /// A service the call needs is away for now (a fleet's directory): retry later.
    #[error("{0}")]
    Unavailable(String),
    /// Anything else that is the host's fault.
    #[error("{0}")]
    Internal(String),
}

impl From<SandboxError> for RuntimeError {
    fn from(e: SandboxError) -> Self {
        match e {
            SandboxError::Agent {
                id,
                call,
                source: ClientError::Remote(info),
            } => RuntimeError::Guest {
                id,
                call,
                code: info.code,
                message: info.message,
            },
            SandboxError::Agent {
                id,
                call,
                source: ClientError::Timeout { what, after },
            } => RuntimeError::Timeout {
                id,
                message: format!("{call}: {what} timed out after {after:?}"),
            },
            other => RuntimeError::Sandbox(other),
        }
    }
}

impl RuntimeError {
    /// Whose fault it is.
    pub fn class(&self) -> ErrorClass {
        match self {
            RuntimeError::NotFound(_)
            | RuntimeError::NoSuchImage(_)
            | RuntimeError::NoSuchSnapshot(_)
            | RuntimeError::NoSuchArtifact(_)
            | RuntimeError::NoSuchWatcher(_) => ErrorClass::NotFound,
            RuntimeError::Cancelled(_) => ErrorClass::Invalid,
            RuntimeError::Template(TemplateError::NotBuilt { .. }) => ErrorClass::NotFound,
            RuntimeError::Template(TemplateError::BadName(_)) => ErrorClass::Invalid,
            RuntimeError::Invalid(_) => ErrorClass::Invalid,
            RuntimeError::Secret(e) => match e {
                crate::secrets::SecretError::NotFound(_) => ErrorClass::NotFound,
                crate::secrets::SecretError::Exists(_) => ErrorClass::Conflict,
                crate::secrets::SecretError::Invalid(_) => ErrorClass::Invalid,
                _ => ErrorClass::Internal,
            },
            RuntimeError::Volume(e) => match e {
                crate::volumes::VolumeError::NotFound(_)
                | crate::volumes::VolumeError::NoSuchPath { .. } => ErrorClass::NotFound,
                crate::volumes::VolumeError::Exists(_)
                | crate::volumes::VolumeError::InUse { .. } => ErrorClass::Conflict,
                crate::volumes::VolumeError::Invalid(_) => ErrorClass::Invalid,
                crate::volumes::VolumeError::Full { .. } => ErrorClass::Capacity,
                crate::volumes::VolumeError::Io { .. } => ErrorClass::Internal,
            },
            RuntimeError::Conflict { .. } => ErrorClass::Conflict,
            RuntimeError::Capacity(_) => ErrorClass::Capacity,
            RuntimeError::Timeout { .. } => ErrorClass::Timeout,
            RuntimeError::Guest { .. } | RuntimeError::Unreachable(_) => ErrorClass::Guest,
            RuntimeError::Unavailable(_) => ErrorClass::Unavailable,
            _ => ErrorClass::Internal,
        }
    }

    /// A stable machine-readable code.
    pub fn code(&self) -> &'static str {
        match self {
            RuntimeError::NotFound(_) => "sandbox_not_found",
            RuntimeError::NoSuchImage(_) => "template_not_found",
            RuntimeError::NoSuchSnapshot(_) => "snapshot_not_found",
            RuntimeError::NoSuchArtifact(_) => "artifact_not_found",
            RuntimeError::NoSuchWatcher(_) => "watcher_not_found",
            RuntimeError::Cancelled(_) => "cancelled",
            RuntimeError::Template(TemplateError::NotBuilt { .. }) => "template_not_found",
            RuntimeError::Template(TemplateError::BadName(_)) => "invalid_request",
            RuntimeError::Template(_) => "template_error",
            RuntimeError::Invalid(_) => "invalid_request",
            RuntimeError::Conflict { .. } => "wrong_state",
            RuntimeError::Secret(e) => match e {
                crate::secrets::SecretError::NotFound(_) => "secret_not_found",
                crate::secrets::SecretError::Exists(_) => "secret_exists",
                crate::secrets::SecretError::Invalid(_) => "invalid_request",
                _ => "secrets_store_error",
            },
            RuntimeError::Volume(e) => match e {
                crate::volumes::VolumeError::NotFound(_) => "volume_not_found",
                crate::volumes::VolumeError::NoSuchPath { .. } => "volume_path_not_found",
                crate::volumes::VolumeError::Exists(_) => "volume_exists",
                crate::volumes::VolumeError::InUse { .. } => "volume_in_use",
                crate::volumes::VolumeError::Invalid(_) => "invalid_request",
                crate::volumes::VolumeError::Full { .. } => "volume_full",
                crate::volumes::VolumeError::Io { .. } => "volume_io_error",
            },
            RuntimeError::Capacity(_) => "capacity",
            RuntimeError::Timeout { .. } => "timeout",
            RuntimeError::Guest { code, .. } => match code {
                ErrorCode::NotFound => "guest_not_found",
                ErrorCode::Exists => "guest_exists",
                ErrorCode::NotADirectory => "guest_not_a_directory",
                ErrorCode::IsADirectory => "guest_is_a_directory",
                ErrorCode::PermissionDenied => "guest_permission_denied",
                ErrorCode::NoSuchProcess => "guest_no_such_process",
                ErrorCode::NoSuchContext => "guest_no_such_context",
                ErrorCode::BadRequest => "guest_bad_request",
                ErrorCode::SpawnFailed => "guest_spawn_failed",
                _ => "guest_error",
            },
            RuntimeError::Sandbox(_) => "sandbox_failed",
            RuntimeError::Store(_) => "store_error",
            RuntimeError::Io { .. } => "host_io_error",
            RuntimeError::Unreachable(_) => "port_unreachable",
            RuntimeError::Unavailable(_) => "unavailable",
            RuntimeError::Internal(_) => "internal",
        }
    }

    /// Sandbox `id` is in `state`, which refuses the call (`message` says why).
    pub fn conflict(id: &str, state: State, message: impl Into<String>) -> Self {
        RuntimeError::Conflict {
            id: id.to_owned(),
            state: state.as_str(),
            message: message.into(),
        }
    }

    pub fn io(what: &'static str, path: &std::path::Path) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.to_path_buf();
        move |source| RuntimeError::Io { what, path, source }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ember_agent::protocol::ErrorInfo;

    #[test]
    fn guest_errors_keep_the_agents_code() {
        let e: RuntimeError = SandboxError::Agent {
            id: "a".into(),
            call: "file_read",
            source: ClientError::Remote(ErrorInfo::new(ErrorCode::NotFound, "no /x")),
        }
        .into();
        assert_eq!(e.code(), "guest_not_found");
        assert_eq!(e.class(), ErrorClass::Guest);
        assert_eq!(
            RuntimeError::NotFound("x".into()).class(),
            ErrorClass::NotFound
        );
        assert_eq!(RuntimeError::Capacity("full".into()).code(), "capacity");
    }
}
