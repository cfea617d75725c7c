//! A node's internal API as a [`Handler`]: what a gateway sends a call through.
//!
//! Blocking (the server calls handlers from blocking threads). A call's events, output and
//! reply come back as they arrive; its input streams up after the request. A caller that
//! goes away stops the call: its event sink says so, or its `Cancel` fires, which the
//! client sees at the next frame (at most [`crate::wire::KEEPALIVE`] later) and answers by
//! closing the connection, which the node takes as cancelling the call.

use std::io::{Cursor, Read, Write};
use std::time::Duration;

use ember_runtime::call::{EventKind, Handler, Io, Reply, Request};
use ember_runtime::RuntimeError;

use crate::wire::{self, kind, WireError};

/// How long a connection to a node may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a node may stay silent (no frame, not even a keepalive) before the call is
/// given up as lost with its node.
const SILENCE: Duration = Duration::from_secs(15);

/// A node's internal API.
#[derive(Debug, Clone)]
pub struct NodeClient {
    /// The node's id (for messages).
    pub node: String,
    url: String,
    token: String,
    agent: ureq::Agent,
}

impl NodeClient {
    /// The client of the node `node` at `addr` (`host:port`), with the node token.
    pub fn new(node: &str, addr: &str, token: &str) -> NodeClient {
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(CONNECT_TIMEOUT)
            .timeout_read(SILENCE)
            .build();
        NodeClient {
            node: node.to_string(),
            url: format!("http://{addr}/internal/v1/call"),
            token: token.to_string(),
            agent,
        }
    }

    fn lost(&self, what: impl std::fmt::Display) -> RuntimeError {
        RuntimeError::Unreachable(format!("node {}: {what}", self.node))
    }
}

impl Handler for NodeClient {
    fn handle(&self, req: Request, io: Io<'_>) -> Result<Reply, RuntimeError> {
        let Io {
            events,
            input,
            output,
            progress: _,
            cancel,
        } = io;
        let json = serde_json::to_vec(&req)
            .map_err(|e| RuntimeError::Internal(format!("encoding the call: {e}")))?;
        let prefix = wire::request_prefix(&json);
        let call = self
            .agent
            .post(&self.url)
            .set("authorization", &format!("Bearer {}", self.token))
            .set("content-type", "application/x-ember-call");
        // Without input the body's length is known: sent with it, in one write (a chunked
        // body costs a round of small writes).
        let sent = match input {
            Some(r) => call.send(Cursor::new(prefix).chain(r)),
            None => call.send_bytes(&prefix),
        };
        let resp = match sent {
            Ok(r) => r,
            Err(ureq::Error::Status(code, r)) => {
                let text = r.into_string().unwrap_or_default();
                return Err(RuntimeError::Internal(format!(
                    "node {} refused the call ({code}): {}",
                    self.node,
                    text.trim()
                )));
            }
            Err(e) => return Err(self.lost(e)),
        };
        let mut body = resp.into_reader();
        let mut events = events;
        let mut output = output;
        loop {
            let frame = wire::read_frame(&mut body).map_err(|e| self.lost(e))?;
            let Some((k, payload)) = frame else {
                return Err(self.lost("the answer ended without a reply"));
            };
            if cancel.as_ref().is_some_and(|c| c.fired()) {
                // Dropping the body closes the connection: the node cancels the call.
                return Err(RuntimeError::Cancelled(format!(
                    "{}: cancelled by the caller",
                    req.name()
                )));
            }
            match k {
                kind::EVENT => {
                    let ev: EventKind = serde_json::from_slice(&payload)
                        .map_err(|e| self.lost(format!("an event it sent: {e}")))?;
                    if let Some(sink) = events.as_mut() {
                        if !sink(&ev) {
                            return Err(RuntimeError::Cancelled(format!(
                                "{}: the caller went away",
                                req.name()
                            )));
                        }
                    }
                }
                kind::DATA => {
                    if let Some(out) = output.as_mut() {
                        out.write_all(&payload).map_err(|e| {
                            RuntimeError::Cancelled(format!("{}: writing out: {e}", req.name()))
                        })?;
                    }
                }
                kind::KEEPALIVE => {}
                kind::REPLY => {
                    finish(&mut body);
                    return serde_json::from_slice(&payload)
                        .map_err(|e| self.lost(format!("its reply: {e}")));
                }
                kind::ERROR => {
                    finish(&mut body);
                    let w: WireError = serde_json::from_slice(&payload)
                        .map_err(|e| self.lost(format!("its error: {e}")))?;
                    return Err(w.into_runtime());
                }
                other => return Err(self.lost(format!("an unknown frame kind {other:#x}"))),
            }
        }
    }
}

/// Reads the (empty) rest of an answer after its last frame, so that the connection goes
/// back to the agent's pool for the next call instead of being closed.
fn finish(body: &mut dyn Read) {
    let mut rest = [0u8; 64];
    while matches!(body.read(&mut rest), Ok(n) if n > 0) {}
}
