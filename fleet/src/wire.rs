//! How a call crosses from a gateway to a node: the runtime's serialized [`Request`], its
//! streams, and its reply or error.
//!
//! The request body is the request's JSON, prefixed by its length (a big-endian `u32`), then
//! the call's input bytes to the end of the body (`write_file`, `stdin_write`). The response
//! body is a sequence of frames, each a kind byte, a big-endian `u32` length and the payload:
//!
//! | kind | payload |
//! |---|---|
//! | `E` | one guest event (`EventKind`, JSON) |
//! | `D` | output bytes (`read_file`) |
//! | `K` | nothing: the call is alive (every [`KEEPALIVE`] while it says nothing else) |
//! | `R` | the reply (`Reply`, JSON); the last frame |
//! | `X` | the error ([`WireError`], JSON); the last frame |
//!
//! The caller going away (the connection closing) cancels the call on the node, as a client
//! that goes away cancels it on a single host.

use std::io::{self, Read, Write};
use std::time::Duration;

use ember_runtime::call::ErrorCode;
use ember_runtime::RuntimeError;
use serde::{Deserialize, Serialize};

/// How often a node says that a silent call is alive.
pub const KEEPALIVE: Duration = Duration::from_secs(2);
/// Largest request JSON (the input bytes after it are not bounded by this).
pub const MAX_REQUEST: u32 = 4 << 20;
/// Largest frame a node sends.
pub const MAX_FRAME: u32 = 16 << 20;

/// Frame kinds.
pub mod kind {
    /// A guest event.
    pub const EVENT: u8 = b'E';
    /// Output bytes.
    pub const DATA: u8 = b'D';
    /// Alive.
    pub const KEEPALIVE: u8 = b'K';
    /// The reply (last).
    pub const REPLY: u8 = b'R';
    /// The error (last).
    pub const ERROR: u8 = b'X';
}

/// A frame's header and payload, as bytes.
pub fn frame(kind: u8, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(5 + payload.len());
    out.push(kind);
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// Reads one frame (`None`: the body ended between frames).
pub fn read_frame(r: &mut dyn Read) -> io::Result<Option<(u8, Vec<u8>)>> {
    let mut head = [0u8; 5];
    let mut got = 0;
    while got < head.len() {
        match r.read(&mut head[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the node's answer ended inside a frame header",
                ))
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]);
    if len > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a frame of {len} bytes is over the limit of {MAX_FRAME}"),
        ));
    }
    let mut payload = vec![0u8; len as usize];
    r.read_exact(&mut payload)?;
    Ok(Some((head[0], payload)))
}

/// The request part of a request body: length and JSON.
pub fn request_prefix(json: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + json.len());
    out.extend_from_slice(&(json.len() as u32).to_be_bytes());
    out.extend_from_slice(json);
    out
}

/// A [`RuntimeError`] as it crosses the wire: its stable code, its message, and what the
/// caller needs to rebuild it (the sandbox, its state, the guest's code).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireError {
    /// [`RuntimeError::code`].
    pub code: String,
    /// The message.
    pub message: String,
    /// The sandbox it is about, where the error names one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<String>,
    /// A conflict's state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
    /// A guest error's code.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest: Option<ErrorCode>,
    /// A guest error's call (`file_stat`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub call: Option<String>,
}

impl WireError {
    /// The wire form of `e`.
    pub fn of(e: &RuntimeError) -> WireError {
        let mut w = WireError {
            code: e.code().to_string(),
            message: e.to_string(),
            sandbox: None,
            state: None,
            guest: None,
            call: None,
        };
        match e {
            RuntimeError::NotFound(id) => w.sandbox = Some(id.clone()),
            RuntimeError::Conflict { id, state, message } => {
                w.sandbox = Some(id.clone());
                w.state = Some(state.to_string());
                w.message = message.clone();
            }
            RuntimeError::Guest {
                id,
                call,
                code,
                message,
            } => {
                w.sandbox = Some(id.clone());
                w.guest = Some(*code);
                w.call = Some(call.to_string());
                w.message = message.clone();
            }
            RuntimeError::Timeout { id, message } => {
                w.sandbox = Some(id.clone());
                w.message = message.clone();
            }
            _ => {}
        }
        w
    }

    /// The error back as the runtime's (the variants whose class and code a caller acts
    /// on; anything else is `Internal` with the node's message).
    pub fn into_runtime(self) -> RuntimeError {
        let id = self.sandbox.clone().unwrap_or_default();
        match self.code.as_str() {
            "sandbox_not_found" => RuntimeError::NotFound(id),
            "template_not_found" => RuntimeError::NoSuchImage(self.message),
            "snapshot_not_found" => RuntimeError::NoSuchSnapshot(self.message),
            "artifact_not_found" => RuntimeError::NoSuchArtifact(self.message),
            "watcher_not_found" => RuntimeError::NoSuchWatcher(self.message),
            "invalid_request" => RuntimeError::Invalid(self.message),
            "cancelled" => RuntimeError::Cancelled(self.message),
            "capacity" => RuntimeError::Capacity(
                self.message
                    .strip_prefix("capacity: ")
                    .unwrap_or(&self.message)
                    .to_string(),
            ),
            "timeout" => RuntimeError::Timeout {
                id,
                message: self.message,
            },
            "wrong_state" => RuntimeError::Conflict {
                id,
                state: state_name(self.state.as_deref()),
                message: self.message,
            },
            "port_unreachable" => RuntimeError::Unreachable(self.message),
            "unavailable" => RuntimeError::Unavailable(self.message),
            _ => match self.guest {
                Some(code) => RuntimeError::Guest {
                    id,
                    call: call_name(self.call.as_deref()),
                    code,
                    message: self.message,
                },
                None => RuntimeError::Internal(self.message),
            },
        }
    }
}

/// A guest call's name as a `&'static str` (what `RuntimeError::Guest` holds): interned, at
/// most [`MAX_CALL_NAMES`] of them (a node is trusted, but a bug must not grow the gateway
/// without bound); others read `remote`.
fn call_name(name: Option<&str>) -> &'static str {
    use std::collections::HashSet;
    use std::sync::{Mutex, OnceLock};
    static NAMES: OnceLock<Mutex<HashSet<&'static str>>> = OnceLock::new();
    let Some(name) = name.filter(|n| n.len() <= 64) else {
        return "remote";
    };
    let mut names = NAMES
        .get_or_init(|| Mutex::new(HashSet::new()))
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some(n) = names.get(name) {
        return n;
    }
    if names.len() >= MAX_CALL_NAMES {
        return "remote";
    }
    let leaked: &'static str = Box::leak(name.to_string().into_boxed_str());
    names.insert(leaked);
    leaked
}

/// Most distinct guest call names [`call_name`] keeps.
const MAX_CALL_NAMES: usize = 256;

/// A sandbox state's name as the runtime spells it (`&'static`).
fn state_name(s: Option<&str>) -> &'static str {
    match s {
        Some("creating") => "creating",
        Some("running") => "running",
        Some("pausing") => "pausing",
        Some("paused") => "paused",
        Some("resuming") => "resuming",
        Some("stopped") => "stopped",
        Some("failed") => "failed",
        _ => "unknown",
    }
}

/// Writes a frame to `w` (a blocking sink of the response body).
pub fn write_frame(w: &mut dyn Write, kind: u8, payload: &[u8]) -> io::Result<()> {
    w.write_all(&frame(kind, payload))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_a_cut_frame_is_an_error() {
        let mut body = frame(kind::EVENT, b"{\"type\":\"stdout\"}");
        body.extend(frame(kind::KEEPALIVE, b""));
        body.extend(frame(kind::REPLY, b"{}"));
        let mut r = &body[..];
        assert_eq!(
            read_frame(&mut r).unwrap(),
            Some((kind::EVENT, b"{\"type\":\"stdout\"}".to_vec()))
        );
        assert_eq!(read_frame(&mut r).unwrap(), Some((kind::KEEPALIVE, vec![])));
        assert_eq!(
            read_frame(&mut r).unwrap(),
            Some((kind::REPLY, b"{}".to_vec()))
        );
        assert_eq!(read_frame(&mut r).unwrap(), None);
        let cut = &body[..3];
        assert!(read_frame(&mut &cut[..]).is_err());
        let mut huge = vec![kind::DATA];
        huge.extend_from_slice(&(MAX_FRAME + 1).to_be_bytes());
        assert!(read_frame(&mut &huge[..]).is_err());
    }

    #[test]
    fn errors_keep_what_callers_act_on() {
        let cases = [
            RuntimeError::NotFound("sb1".into()),
            RuntimeError::Conflict {
                id: "sb1".into(),
                state: "paused",
                message: "only a running sandbox can pause".into(),
            },
            RuntimeError::Guest {
                id: "sb1".into(),
                call: "file_stat",
                code: ErrorCode::NotFound,
                message: "no /x".into(),
            },
            RuntimeError::Capacity("full".into()),
            RuntimeError::NoSuchWatcher("watcher with id w1 not found".into()),
        ];
        for e in cases {
            let w = WireError::of(&e);
            let text = serde_json::to_string(&w).unwrap();
            let back: WireError = serde_json::from_str(&text).unwrap();
            let r = back.into_runtime();
            assert_eq!(r.code(), e.code(), "{e}");
            assert_eq!(r.class(), e.class(), "{e}");
            assert_eq!(r.to_string(), e.to_string(), "{e}");
        }
    }
}
