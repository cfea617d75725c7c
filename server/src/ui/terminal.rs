//! The dashboard's terminal: `GET /ui/api/sandboxes/{id}/terminal`, a WebSocket bridged to a
//! shell on a PTY in the sandbox (`docs/api.md`, "The dashboard").
//!
//! - Auth: the session cookie (the `/ui/api` layer, 401 without it); a browser cannot set
//!   headers on a WebSocket, so the CSRF token comes as one of the offered subprotocols,
//!   `csrf.<token>` (beside [`PROTOCOL`], the one the server picks), and `Origin` must be
//!   this server's own (`http(s)://` + `Host`): 403 otherwise, before the upgrade.
//! - Messages: binary from the browser = keystrokes (the shell's terminal input); text from
//!   the browser = a control message, `{"type":"resize","cols":C,"rows":R}`; binary to the
//!   browser = terminal output; text to the browser = `{"type":"exit",...}` or
//!   `{"type":"error","message":...}` just before the server closes.
//! - The shell: a `ProcessStart` with a [`PtySize`], `ProcessAttach` for its output,
//!   `StdinWrite` for its input, `ProcessResize`; closing the socket kills it (SIGKILL through
//!   `ProcessSignal`) and forgets its record.
//! - Bounds: messages of at most [`MAX_MESSAGE`] bytes; output moves through a channel of
//!   [`OUTPUT_QUEUE`] chunks, so a guest that writes faster than the browser reads is held
//!   back (the attach waits) rather than buffered here; at most [`MAX_TERMINALS`] at once.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Extension, Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use ember_runtime::call::{self, Cancel, EventKind, ExecRequest, Io, PtySize};
use futures_util::{SinkExt, StreamExt};
use serde::Deserialize;
use serde_json::json;
use tokio::sync::mpsc;

use super::session::{self, SessionError};
use super::SessionId;
use crate::error::ApiError;
use crate::AppState;

/// The subprotocol the server answers with.
pub const PROTOCOL: &str = "ember-terminal";
/// The prefix of the subprotocol that carries the CSRF token.
pub const CSRF_PROTOCOL_PREFIX: &str = "csrf.";
/// Largest WebSocket message either way, bytes.
pub const MAX_MESSAGE: usize = 64 << 10;
/// Output chunks queued towards the browser before the attach waits.
pub const OUTPUT_QUEUE: usize = 32;
/// Most terminals open at once (server-wide).
pub const MAX_TERMINALS: usize = 64;
/// Largest terminal side, cells.
pub const MAX_SIDE: u16 = 1000;

static OPEN: AtomicUsize = AtomicUsize::new(0);

/// Whether `origin` (the request's `Origin`) is this server's own, `http(s)://` + `host`.
pub fn origin_ok(origin: Option<&str>, host: Option<&str>) -> bool {
    let (Some(origin), Some(host)) = (origin, host) else {
        return false;
    };
    let host = host.trim();
    let rest = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"));
    match rest {
        Some(r) => !host.is_empty() && r.eq_ignore_ascii_case(host),
        None => false,
    }
}

/// The CSRF token among the offered subprotocols (`Sec-WebSocket-Protocol`, comma-separated).
pub fn csrf_from_protocols<'a>(values: impl Iterator<Item = &'a str>) -> Option<String> {
    values
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .find_map(|p| p.strip_prefix(CSRF_PROTOCOL_PREFIX))
        .map(str::to_string)
}

/// A control message from the browser.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Control {
    /// The terminal's new size, in cells.
    Resize {
        /// Columns.
        cols: u16,
        /// Rows.
        rows: u16,
    },
}

/// Parses a text message; sizes are checked (1..=[`MAX_SIDE`]).
pub fn parse_control(text: &str) -> Result<Control, String> {
    let c: Control = serde_json::from_str(text).map_err(|e| format!("bad control message: {e}"))?;
    match c {
        Control::Resize { cols, rows } => {
            if cols == 0 || rows == 0 || cols > MAX_SIDE || rows > MAX_SIDE {
                return Err(format!(
                    "bad terminal size {cols}x{rows} (1 to {MAX_SIDE} a side)"
                ));
            }
        }
    }
    Ok(c)
}

/// `?cols=&rows=`: the first size.
#[derive(Debug, Default, Deserialize)]
pub struct SizeQuery {
    #[serde(default)]
    cols: Option<u16>,
    #[serde(default)]
    rows: Option<u16>,
}

fn refuse(status: StatusCode, code: &'static str, msg: impl Into<String>) -> Response {
    ApiError::new(status, code, msg.into()).into_response()
}

/// One open terminal in the count; released when dropped.
struct Slot;

impl Slot {
    fn take() -> Option<Slot> {
        if OPEN.fetch_add(1, Ordering::SeqCst) >= MAX_TERMINALS {
            OPEN.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        Some(Slot)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        OPEN.fetch_sub(1, Ordering::SeqCst);
    }
}

/// `GET /ui/api/sandboxes/{id}/terminal`: checks Origin and the CSRF subprotocol, then
/// upgrades and bridges.
pub(super) async fn terminal(
    State(st): State<AppState>,
    Path(id): Path<String>,
    Query(q): Query<SizeQuery>,
    Extension(SessionId(sid)): Extension<SessionId>,
    headers: HeaderMap,
    ws: Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
) -> Response {
    let origin = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok());
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok());
    if !origin_ok(origin, host) {
        return refuse(
            StatusCode::FORBIDDEN,
            "origin",
            "the terminal's WebSocket must come from this server's own page (Origin)",
        );
    }
    let csrf = match st.inner.ui.check(&sid, Instant::now()) {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    let given = csrf_from_protocols(
        headers
            .get_all(header::SEC_WEBSOCKET_PROTOCOL)
            .iter()
            .filter_map(|v| v.to_str().ok()),
    );
    if session::csrf_ok(given.as_deref(), &csrf).is_err() {
        return SessionError::Csrf.into_response();
    }
    let ws = match ws {
        Ok(ws) => ws,
        Err(e) => return e.into_response(),
    };
    let Some(slot) = Slot::take() else {
        return refuse(
            StatusCode::TOO_MANY_REQUESTS,
            "too_many_terminals",
            format!("at most {MAX_TERMINALS} terminals are open at once"),
        );
    };
    let size = PtySize {
        cols: q.cols.unwrap_or(80).clamp(1, MAX_SIDE),
        rows: q.rows.unwrap_or(24).clamp(1, MAX_SIDE),
    };
    ws.protocols([PROTOCOL])
        .max_message_size(MAX_MESSAGE)
        .max_frame_size(MAX_MESSAGE)
        .on_upgrade(move |socket| async move {
            let _slot = slot;
            bridge(st, id, size, socket).await;
        })
}

/// What the attach thread reports.
enum Out {
    Data(Vec<u8>),
    End(String),
}

/// Runs the shell and moves bytes both ways until either side ends.
async fn bridge(st: AppState, id: String, size: PtySize, socket: WebSocket) {
    let (mut tx, mut rx) = socket.split();
    let req = ExecRequest {
        argv: vec![
            "/bin/sh".into(),
            "-c".into(),
            "if command -v bash >/dev/null 2>&1; then exec bash -i; else exec sh -i; fi".into(),
        ],
        env: [("TERM".to_string(), "xterm-256color".to_string())]
            .into_iter()
            .collect(),
        background: true,
        pty: Some(size),
        ..Default::default()
    };
    let sid = id.clone();
    let started = st
        .call(move |b| {
            b.call(
                call::ProcessStart {
                    id: sid,
                    req,
                    tag: Some("ui-terminal".into()),
                    config: json!({"ui": "terminal"}),
                },
                Io::none(),
            )
        })
        .await;
    let pid = match started {
        Ok(pid) => pid,
        Err(e) => {
            let msg = json!({"type": "error", "message": e.message}).to_string();
            let _ = tx.send(Message::Text(msg.into())).await;
            let _ = tx.close().await;
            return;
        }
    };
    tracing::info!(sandbox = %id, pid, "dashboard terminal opened");

    // Output: the attach (a blocking call) → a bounded channel → the socket.
    let abort = Cancel::new();
    let (out_tx, mut out_rx) = mpsc::channel::<Out>(OUTPUT_QUEUE);
    let attach_abort = abort.clone();
    let sid = id.clone();
    let b = st.backend();
    let attach = tokio::task::spawn_blocking(move || {
        let mut on_event = |ev: &EventKind| match ev {
            EventKind::Stdout { data } | EventKind::Stderr { data } => {
                out_tx.blocking_send(Out::Data(data.clone())).is_ok()
            }
            _ => true,
        };
        let r = b.call(
            call::ProcessAttach { id: sid, pid },
            Io::events(&mut on_event).with_cancel(attach_abort),
        );
        let end = match r {
            Ok(end) => json!({"type": "exit", "end": end}),
            Err(e) => json!({"type": "error", "message": e.to_string()}),
        };
        let _ = out_tx.blocking_send(Out::End(end.to_string()));
    });
    let writer = tokio::spawn(async move {
        while let Some(m) = out_rx.recv().await {
            match m {
                Out::Data(d) => {
                    for chunk in d.chunks(MAX_MESSAGE) {
                        if tx
                            .send(Message::Binary(chunk.to_vec().into()))
                            .await
                            .is_err()
                        {
                            return;
                        }
                    }
                }
                Out::End(text) => {
                    let _ = tx.send(Message::Text(text.into())).await;
                    let _ = tx.close().await;
                    return;
                }
            }
        }
    });

    // Input: the socket → a bounded channel → one long `StdinWrite`.
    let (in_tx, in_rx) = mpsc::channel::<Vec<u8>>(16);
    let sid = id.clone();
    let stdin = st.spawn(move |b| {
        let mut input = ChannelReader {
            rx: in_rx,
            chunk: Vec::new(),
            at: 0,
        };
        b.call(call::StdinWrite { id: sid, pid }, Io::input(&mut input))
            .map(drop)
    });
    let mut writer = writer;
    loop {
        tokio::select! {
            _ = &mut writer => break,
            m = rx.next() => match m {
                Some(Ok(Message::Binary(data))) => {
                    if !data.is_empty() && in_tx.send(data.to_vec()).await.is_err() {
                        break;
                    }
                }
                Some(Ok(Message::Text(text))) => match parse_control(text.as_str()) {
                    Ok(Control::Resize { cols, rows }) => {
                        let sid = id.clone();
                        let r = st
                            .call(move |b| {
                                b.call(call::ProcessResize { id: sid, pid, cols, rows }, Io::none())
                            })
                            .await;
                        if let Err(e) = r {
                            tracing::debug!("terminal resize: {e:?}");
                        }
                    }
                    Err(e) => tracing::debug!("terminal: {e}"),
                },
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => break,
                Some(Ok(_)) => {} // ping/pong: answered by the library
            },
        }
    }
    // The socket closed (or the shell ended): kill the shell, stop the streams, forget it.
    abort.fire();
    drop(in_tx);
    writer.abort();
    let sid = id.clone();
    let _ = st
        .call(move |b| {
            let kill = call::ProcessSignal {
                id: sid.clone(),
                pid: pid as i32,
                signal: libc::SIGKILL,
            };
            if let Err(e) = b.call(kill, Io::none()) {
                tracing::debug!("killing the terminal's shell {pid}: {e}");
            }
            Ok(())
        })
        .await;
    let _ = attach.await;
    let _ = stdin.await;
    let sid = id.clone();
    let _ = st
        .call(move |b| {
            b.call(
                call::ProcessForget {
                    id: sid,
                    pid: Some(pid),
                },
                Io::none(),
            )
        })
        .await;
    tracing::info!(sandbox = %id, pid, "dashboard terminal closed");
}

/// The chunks of a channel as one byte stream (`StdinWrite`'s input).
struct ChannelReader {
    rx: mpsc::Receiver<Vec<u8>>,
    chunk: Vec<u8>,
    at: usize,
}

impl std::io::Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.at >= self.chunk.len() {
            match self.rx.blocking_recv() {
                Some(c) => {
                    self.chunk = c;
                    self.at = 0;
                }
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.chunk.len() - self.at);
        buf[..n].copy_from_slice(&self.chunk[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origin_must_be_this_server() {
        let h = Some("127.0.0.1:3000");
        assert!(origin_ok(Some("http://127.0.0.1:3000"), h));
        assert!(origin_ok(Some("https://127.0.0.1:3000"), h));
        assert!(!origin_ok(Some("http://evil.example"), h));
        assert!(!origin_ok(Some("http://127.0.0.1:3001"), h));
        assert!(!origin_ok(Some("http://127.0.0.1:3000.evil.example"), h));
        assert!(!origin_ok(Some("null"), h));
        assert!(!origin_ok(None, h));
        assert!(!origin_ok(Some("http://"), Some("")));
        assert!(!origin_ok(Some("http://x"), None));
    }

    #[test]
    fn csrf_comes_from_the_offered_protocols() {
        let v = ["ember-terminal, csrf.abc123"];
        assert_eq!(
            csrf_from_protocols(v.iter().copied()),
            Some("abc123".into())
        );
        let v = ["ember-terminal", "csrf.zz"];
        assert_eq!(csrf_from_protocols(v.iter().copied()), Some("zz".into()));
        let v = ["ember-terminal"];
        assert_eq!(csrf_from_protocols(v.iter().copied()), None);
        assert!(session::csrf_ok(None, "abc").is_err());
    }

    #[test]
    fn control_messages() {
        assert_eq!(
            parse_control(r#"{"type":"resize","cols":120,"rows":40}"#),
            Ok(Control::Resize {
                cols: 120,
                rows: 40
            })
        );
        assert!(parse_control(r#"{"type":"resize","cols":0,"rows":40}"#).is_err());
        assert!(parse_control(r#"{"type":"resize","cols":5000,"rows":40}"#).is_err());
        assert!(parse_control(r#"{"type":"resize","cols":-1,"rows":40}"#).is_err());
        assert!(parse_control(r#"{"type":"resize","cols":1,"rows":1,"x":1}"#).is_err());
        assert!(parse_control(r#"{"type":"kill"}"#).is_err());
        assert!(parse_control("ls\r").is_err());
    }
}
