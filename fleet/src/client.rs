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
/// How long a probe of a node may take, all told.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// A node's internal API.
#[derive(Debug, Clone)]
pub struct NodeClient {
    /// The node's id (for messages).
    pub node: String,
    url: String,
    token: String,
    agent: ureq::Agent,
    probe: ureq::Agent,
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
            probe: ureq::AgentBuilder::new().timeout(PROBE_TIMEOUT).build(),
        }
    }

    /// Asks the node to take in paused sandbox `r.id` from its upload (the blob store).
    pub fn adopt(
        &self,
        r: &crate::node::AdoptRequest,
    ) -> Result<crate::node::AdoptReply, RuntimeError> {
        let url = self.url.replace("/internal/v1/call", "/internal/v1/adopt");
        let resp = self
            .agent
            .post(&url)
            .set("authorization", &format!("Bearer {}", self.token))
            .send_json(r);
        match resp {
            Ok(r) => r
                .into_json()
                .map_err(|e| self.lost(format!("its answer to a move: {e}"))),
            Err(ureq::Error::Status(_, r)) => Err(RuntimeError::Unreachable(format!(
                "node {} did not take sandbox in: {}",
                self.node,
                r.into_string().unwrap_or_default()
            ))),
            Err(e) => Err(self.lost(e)),
        }
    }

    /// The gateways' probe of the node (`GET /internal/v1/ping`): answered within
    /// [`PROBE_TIMEOUT`] or failed.
    pub fn ping(&self) -> Result<crate::node::Ping, RuntimeError> {
        let url = self.url.replace("/internal/v1/call", "/internal/v1/ping");
        self.probe
            .get(&url)
            .set("authorization", &format!("Bearer {}", self.token))
            .call()
            .map_err(|e| self.lost(e))?
            .into_json()
            .map_err(|e| self.lost(format!("its answer to a probe: {e}")))
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
                let msg = format!(
                    "node {} refused the call ({code}): {}",
                    self.node,
                    text.trim()
                );
                // 503: the node is fenced (it will take calls again, or its sandboxes go
                // elsewhere): the caller may follow the sandbox.
                return Err(if code == 503 {
                    RuntimeError::Unavailable(msg)
                } else {
                    RuntimeError::Internal(msg)
                });
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

#[cfg(test)]
mod tests {
    use super::*;
    use ember_runtime::call::{self, Cancel, Reply};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Instant;

    /// A node's runtime stand-in: a few calls, each exercising one part of the wire.
    #[derive(Default)]
    struct Fake {
        cancelled: AtomicBool,
    }

    impl Handler for Fake {
        fn handle(&self, req: Request, io: Io<'_>) -> Result<Reply, RuntimeError> {
            match req {
                Request::RunCode(_) => {
                    let sink = io.events.expect("events");
                    for text in ["a\n", "b\n"] {
                        let ev = EventKind::Stdout {
                            data: text.as_bytes().to_vec(),
                        };
                        assert!(sink(&ev));
                    }
                    Ok(Reply::RunCode(ember_runtime::RunEnd {
                        status: call::EndStatus::Ok,
                        execution_count: Some(1),
                        duration_ms: Some(1),
                    }))
                }
                Request::WriteFile(_) => {
                    let mut n = 0u64;
                    let input = io.input.expect("input");
                    let mut buf = [0u8; 4096];
                    loop {
                        let k = input.read(&mut buf).unwrap();
                        if k == 0 {
                            break;
                        }
                        n += k as u64;
                    }
                    Ok(Reply::WriteFile(n))
                }
                Request::ReadFile(_) => {
                    let out = io.output.expect("output");
                    let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
                    out.write_all(&data).unwrap();
                    Ok(Reply::ReadFile(data.len() as u64))
                }
                Request::ProcessAttach(_) => {
                    // Silent until cancelled (a quiet process).
                    let cancel = io.cancel.expect("cancel");
                    let t0 = Instant::now();
                    while !cancel.fired() && t0.elapsed() < Duration::from_secs(20) {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    self.cancelled.store(cancel.fired(), Ordering::SeqCst);
                    Err(RuntimeError::Cancelled("attach: cancelled".into()))
                }
                Request::Get(g) => Err(RuntimeError::NotFound(g.id)),
                other => Err(RuntimeError::Internal(format!("fake: {}", other.name()))),
            }
        }
    }

    /// Serves `fake` as a node's internal API on a loopback port; answers its address.
    fn serve(fake: Arc<Fake>) -> String {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                tx.send(l.local_addr().unwrap().to_string()).unwrap();
                let app =
                    crate::node::router("fake", fake, "tok".into(), None, None, Default::default());
                axum::serve(l, app).await.unwrap();
            });
        });
        rx.recv().unwrap()
    }

    #[test]
    fn calls_cross_the_wire_with_their_streams_errors_and_cancellation() {
        let fake = Arc::new(Fake::default());
        let addr = serve(fake.clone());
        let c = NodeClient::new("n1", &addr, "tok");

        // Events in order, then the reply.
        let mut seen = Vec::new();
        let mut sink = |ev: &EventKind| {
            if let EventKind::Stdout { data } = ev {
                seen.push(String::from_utf8_lossy(data).into_owned());
            }
            true
        };
        let req = call::RunCode {
            id: "sb".into(),
            req: Default::default(),
        };
        let r = c.handle(req.into(), Io::events(&mut sink)).unwrap();
        assert!(matches!(r, Reply::RunCode(_)));
        assert_eq!(seen, ["a\n", "b\n"]);

        // Input after the request, to its end.
        let data = vec![7u8; 1 << 20];
        let mut input = &data[..];
        let req = call::WriteFile {
            id: "sb".into(),
            path: "/x".into(),
            user: Default::default(),
        };
        let r = c.handle(req.into(), Io::input(&mut input)).unwrap();
        assert!(matches!(r, Reply::WriteFile(n) if n == 1 << 20));

        // Output bytes in frames, intact.
        let mut out = Vec::new();
        let req = call::ReadFile {
            id: "sb".into(),
            path: "/x".into(),
        };
        let r = c.handle(req.into(), Io::output(&mut out)).unwrap();
        assert!(matches!(r, Reply::ReadFile(300_000)));
        assert!(out.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8));

        // Errors keep their kind.
        let e = c
            .handle(call::Get { id: "gone".into() }.into(), Io::none())
            .unwrap_err();
        assert!(
            matches!(e, RuntimeError::NotFound(ref id) if id == "gone"),
            "{e}"
        );

        // A caller's cancel reaches the node's call (at the next keepalive at the latest).
        let cancel = Cancel::new();
        let fire = cancel.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            fire.fire();
        });
        let t0 = Instant::now();
        let req = call::ProcessAttach {
            id: "sb".into(),
            pid: 7,
        };
        let e = c
            .handle(req.into(), Io::none().with_cancel(cancel))
            .unwrap_err();
        assert!(matches!(e, RuntimeError::Cancelled(_)), "{e}");
        assert!(
            t0.elapsed() < crate::wire::KEEPALIVE * 2,
            "{:?}",
            t0.elapsed()
        );
        let t1 = Instant::now();
        while !fake.cancelled.load(Ordering::SeqCst) && t1.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(
            fake.cancelled.load(Ordering::SeqCst),
            "the node's call was not cancelled"
        );

        // The node token is required.
        let wrong = NodeClient::new("n1", &addr, "nope");
        let e = wrong
            .handle(call::Get { id: "x".into() }.into(), Io::none())
            .unwrap_err();
        assert!(e.to_string().contains("401"), "{e}");
    }
}
